// Stacks and context switches of the emulated threads (see context.h).
#include "context.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <stdexcept>

namespace cnr_emu {

Stack::Stack() : page_(static_cast<size_t>(sysconf(_SC_PAGESIZE))) {
  base_ = mmap(nullptr, page_ + kStackBytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (base_ == MAP_FAILED) throw std::runtime_error("cnr_emu: cannot map a fiber stack");
  if (mprotect(base_, page_, PROT_NONE) != 0) {
    munmap(base_, page_ + kStackBytes);
    throw std::runtime_error("cnr_emu: cannot protect a fiber stack's guard page");
  }
}

Stack::~Stack() { munmap(base_, page_ + kStackBytes); }

void* Stack::bottom() const { return static_cast<char*>(base_) + page_; }

#if defined(__x86_64__)

// cnr_emu_swap_stack(&from_sp, to_sp): pushes what the SysV ABI makes a callee
// preserve (rbp, rbx, r12-r15, the SSE and x87 control words), saves the stack
// pointer in *from_sp, then pops the same from to_sp and returns on that stack.
extern "C" void cnr_emu_swap_stack(void** from_sp, void* to_sp);
asm(R"(
    .pushsection .text
    .p2align 4
    .globl cnr_emu_swap_stack
    .hidden cnr_emu_swap_stack
    .type cnr_emu_swap_stack, @function
cnr_emu_swap_stack:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    subq $8, %rsp
    stmxcsr (%rsp)
    fnstcw 4(%rsp)
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    ldmxcsr (%rsp)
    fldcw 4(%rsp)
    addq $8, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size cnr_emu_swap_stack, .-cnr_emu_swap_stack
    .popsection
)");

namespace {

// With CET shadow stacks on, `ret` onto another stack would fault. rdsspq is a
// no-op (leaving 0) unless a shadow stack is active.
bool shadow_stack_active() {
  unsigned long long ssp = 0;
  asm volatile("rdsspq %0" : "+r"(ssp));
  return ssp != 0;
}

// The frame cnr_emu_swap_stack pops to enter entry() on a fresh stack.
void* initial_frame(const Stack& stack, void (*entry)()) {
  const auto top = (reinterpret_cast<uintptr_t>(stack.bottom()) + kStackBytes) & ~uintptr_t{15};
  auto* sp = reinterpret_cast<uintptr_t*>(top);
  *--sp = 0;                                   // entry()'s return address: it never returns
  *--sp = reinterpret_cast<uintptr_t>(entry);  // where `ret` goes; entry then sees rsp = 8 mod 16, as after a call
  for (int i = 0; i < 6; ++i) *--sp = 0;       // rbp, rbx, r12-r15
  uint32_t mxcsr;
  uint16_t fpu_cw;
  asm volatile("stmxcsr %0" : "=m"(mxcsr));
  asm volatile("fnstcw %0" : "=m"(fpu_cw));
  *--sp = 0;
  std::memcpy(sp, &mxcsr, sizeof mxcsr);
  std::memcpy(reinterpret_cast<char*>(sp) + 4, &fpu_cw, sizeof fpu_cw);
  return sp;
}

}  // namespace

bool Context::fast_switch() {
  static const bool available = !shadow_stack_active();
  const char* env = std::getenv("CNR_CUDA_EMU_SWITCH");
  return available && !(env != nullptr && std::strcmp(env, "ucontext") == 0);
}

#else

extern "C" void cnr_emu_swap_stack(void**, void*) { std::abort(); }  // never called: fast_switch() is false
namespace {
void* initial_frame(const Stack&, void (*)()) { return nullptr; }
}  // namespace
bool Context::fast_switch() { return false; }

#endif

void Context::start(const Stack& stack, void (*entry)(), bool fast) {
  if (fast) {
    sp_ = initial_frame(stack, entry);
    return;
  }
  if (!has_uc_) {  // once per context: getcontext() is a system call
    if (getcontext(&uc_) != 0) throw std::runtime_error("cnr_emu: getcontext failed");
    has_uc_ = true;
  }
  uc_.uc_stack.ss_sp = stack.bottom();
  uc_.uc_stack.ss_size = kStackBytes;
  uc_.uc_link = nullptr;
  makecontext(&uc_, entry, 0);
}

void Context::swap(Context& from, Context& to, bool fast) {
  if (fast) {
    cnr_emu_swap_stack(&from.sp_, to.sp_);
  } else if (swapcontext(&from.uc_, &to.uc_) != 0) {
    std::abort();  // cannot fail with contexts made by getcontext / makecontext
  }
}

}  // namespace cnr_emu
