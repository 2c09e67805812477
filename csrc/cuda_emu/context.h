// Execution contexts of the emulated threads (context.cpp): a stack each, and
// a switch from one to another.
//
// Two ways to switch. ucontext's swapcontext() works everywhere but saves the
// signal mask with a system call each time (~170 ns here), and a block of
// warp-synchronous code switches tens of times per value; on x86-64 a switch of
// our own saves only what the ABI makes the callee keep (~10 ns). It stays off
// where the process runs with CET shadow stacks, whose bookkeeping only ucontext
// does, and CNR_CUDA_EMU_SWITCH=ucontext forces the portable way (for tests).
#pragma once

#include <ucontext.h>

#include <cstddef>

namespace cnr_emu {

constexpr size_t kStackBytes = 64 * 1024;

// A fiber stack with a PROT_NONE page below it, so that an overflow faults at
// once instead of corrupting the stack of the neighbouring thread.
class Stack {
 public:
  Stack();
  ~Stack();
  Stack(const Stack&) = delete;
  Stack& operator=(const Stack&) = delete;
  void* bottom() const;  // lowest usable byte; the stack grows down from bottom() + kStackBytes

 private:
  size_t page_;
  void* base_;
};

// Where a fiber, or the scheduler, resumes. Must not move once used (ucontext
// keeps a pointer into itself).
class Context {
 public:
  Context() = default;
  Context(const Context&) = delete;
  Context& operator=(const Context&) = delete;

  // Whether the fast switch may be used: x86-64, no shadow stack, not disabled by the environment.
  static bool fast_switch();

  // Prepares this context to run entry() on `stack` from its start; entry() must never return.
  void start(const Stack& stack, void (*entry)(), bool fast);

  // Saves the running context into `from` and resumes `to`. Both sides use the same `fast`.
  static void swap(Context& from, Context& to, bool fast);

 private:
  void* sp_ = nullptr;  // fast switch: the saved stack pointer
  ucontext_t uc_;       // portable switch
  bool has_uc_ = false;
};

}  // namespace cnr_emu
