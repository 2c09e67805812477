// The scheduler of the CUDA emulation (see runtime.h for what it promises).
//
// Each emulated thread is a fiber (context.h) on a pooled 64 KiB stack with a
// guard page. A block runs in phases: every runnable fiber runs, in an order
// drawn from the seed, until it waits at a barrier, exits or faults; then the
// barriers whose participants have all arrived release them. A phase that
// releases nothing while threads still wait is a deadlock, reported as an error.
// Warp operations exchange through the fibers' own records: each lane deposits
// its value before it waits, and the release computes every lane's result.
#include "runtime.h"

#include <cuda_runtime.h>  // the error codes

#include "context.h"

#include <cstdio>
#include <cstdlib>
#include <memory>
#include <numeric>
#include <stdexcept>
#include <string>
#include <vector>

namespace cnr_emu {
namespace {

constexpr int kWarpSize = 32;
constexpr uint64_t kDefaultSeed = 1;

enum class State : uint8_t { kRunnable, kAtBlockBarrier, kAtWarpBarrier, kExited, kFaulted };

// One emulated thread. Its context and stack are reused by the thread of the
// same index in every later block, so neither may move: fibers live behind unique_ptr.
struct Fiber {
  Context context;
  Stack stack;
  uint3 tid{0, 0, 0};
  int index = 0, warp = 0, lane = 0;
  State state = State::kExited;
  // The barrier it waits at: what it brings, and what it takes back.
  WarpOp op = WarpOp::kSync;
  BlockOp block_op = BlockOp::kSync;
  unsigned mask = 0;
  int arg = 0, width = kWarpSize;
  uint64_t value = 0, result = 0;
};

// splitmix64: small, and good enough to shuffle threads.
class Rng {
 public:
  explicit Rng(uint64_t seed) : s_(seed) {}
  uint64_t next() {
    uint64_t z = (s_ += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  uint64_t below(uint64_t n) { return next() % n; }

 private:
  uint64_t s_;
};

// Everything the emulation keeps per host thread.
struct Runtime {
  std::vector<std::unique_ptr<Fiber>> fibers;
  Context scheduler;
  bool fast_switch = false;  // per launch, see context.h
  const LaunchSpec* spec = nullptr;  // the launch being run
  void (*thread_main)(void*) = nullptr;
  void* ctx = nullptr;
  Fiber* current = nullptr;  // the fiber running now, or null on the scheduler
  std::string fault;         // set by a thread that faults
  int error_code = 0;        // the pending launch error (cudaGetLastError)
  std::string error_message;
};

Runtime& runtime() {
  static thread_local Runtime rt;
  return rt;
}

const char* op_name(WarpOp op) {
  switch (op) {
    case WarpOp::kSync: return "__syncwarp";
    case WarpOp::kShfl: return "__shfl_sync";
    case WarpOp::kShflUp: return "__shfl_up_sync";
    case WarpOp::kShflDown: return "__shfl_down_sync";
    case WarpOp::kShflXor: return "__shfl_xor_sync";
    case WarpOp::kAny: return "__any_sync";
    case WarpOp::kAll: return "__all_sync";
    case WarpOp::kBallot: return "__ballot_sync";
  }
  return "a warp operation";
}

std::string hex(unsigned v) {
  char buf[16];
  std::snprintf(buf, sizeof buf, "0x%08x", v);
  return buf;
}

std::string triple(uint3 v) {
  return "(" + std::to_string(v.x) + ", " + std::to_string(v.y) + ", " + std::to_string(v.z) + ")";
}

// "cnr_emu: kernel K, block (x, y, z)", the start of every fault message.
std::string where(const Runtime& rt) {
  return std::string("cnr_emu: kernel ") + rt.spec->kernel + ", block " + triple(blockIdx);
}

std::string describe(const Fiber& f) {
  return "thread " + triple(f.tid) + " (warp " + std::to_string(f.warp) + ", lane " + std::to_string(f.lane) + ")";
}

// ---- fibers ---------------------------------------------------------------------

void fiber_main() {
  Runtime& rt = runtime();
  Fiber& self = *rt.current;
  try {
    rt.thread_main(rt.ctx);
    self.state = State::kExited;
  } catch (const std::exception& e) {
    rt.fault = where(rt) + ", " + describe(self) + ": " + e.what();
    self.state = State::kFaulted;
  } catch (...) {
    rt.fault = where(rt) + ", " + describe(self) + ": an unknown exception";
    self.state = State::kFaulted;
  }
  Context::swap(self.context, rt.scheduler, rt.fast_switch);
  std::abort();  // a finished thread is never resumed
}

// Parks the calling fiber in `state` until the scheduler resumes it.
void park(Runtime& rt, State state) {
  Fiber& self = *rt.current;
  self.state = state;
  Context::swap(self.context, rt.scheduler, rt.fast_switch);
}

Fiber& calling_thread(Runtime& rt, const char* what) {
  if (rt.current == nullptr) throw std::logic_error(std::string("cnr_emu: ") + what + " called outside a kernel");
  return *rt.current;
}

// Prepares fibers 0..n-1 to run the block's threads from the start.
void start_threads(Runtime& rt, unsigned n) {
  while (rt.fibers.size() < n) rt.fibers.push_back(std::make_unique<Fiber>());
  const dim3 b = blockDim;
  for (unsigned i = 0; i < n; ++i) {
    Fiber& f = *rt.fibers[i];
    f.context.start(f.stack, fiber_main, rt.fast_switch);
    f.tid = {i % b.x, (i / b.x) % b.y, i / (b.x * b.y)};
    f.index = static_cast<int>(i);
    f.warp = static_cast<int>(i / kWarpSize);
    f.lane = static_cast<int>(i % kWarpSize);
    f.state = State::kRunnable;
  }
}

// Runs fiber `f` until it waits, exits or faults.
void resume(Runtime& rt, Fiber& f) {
  rt.current = &f;
  threadIdx = f.tid;
  Context::swap(rt.scheduler, f.context, rt.fast_switch);
  rt.current = nullptr;
  if (f.state == State::kFaulted) throw std::runtime_error(rt.fault);
}

// ---- barriers ---------------------------------------------------------------------

// Where a waiting thread is, for error messages.
std::string waiting_at(const Fiber& f) {
  switch (f.state) {
    case State::kAtBlockBarrier: return "waits at __syncthreads()";
    case State::kAtWarpBarrier: return "waits at " + std::string(op_name(f.op)) + " with mask " + hex(f.mask);
    case State::kExited: return "has exited";
    default: return "is running";
  }
}

std::runtime_error warp_fault(const Runtime& rt, const Fiber& f, const std::string& what) {
  return std::runtime_error(where(rt) + ", " + describe(f) + " at " + op_name(f.op) + " with mask " + hex(f.mask) +
                            ": " + what);
}

// The thread of lane `lane` in warp `warp`, or null past the block's last thread.
Fiber* lane_fiber(Runtime& rt, unsigned n, int warp, int lane) {
  const unsigned i = static_cast<unsigned>(warp * kWarpSize + lane);
  return i < n ? rt.fibers[i].get() : nullptr;
}

// Whether every lane named in f's mask waits at f's operation with f's mask. A
// lane that can never arrive (exited, or no such thread) or that waits at
// another operation with the same mask is a fault.
bool group_complete(Runtime& rt, unsigned n, const Fiber& f) {
  const auto named = [](int lane) { return "lane " + std::to_string(lane) + ", named in the mask, "; };
  for (unsigned m = f.mask; m != 0; m &= m - 1) {
    const int lane = __builtin_ctz(m);
    const Fiber* g = lane_fiber(rt, n, f.warp, lane);
    if (g == nullptr) throw warp_fault(rt, f, named(lane) + "is not a thread of this block (its last warp is partial)");
    if (g->state == State::kExited) {
      throw warp_fault(rt, f, named(lane) + "has exited; every lane of the mask must take part");
    }
    if (g->state != State::kAtWarpBarrier || g->mask != f.mask) return false;
    if (g->op != f.op) throw warp_fault(rt, f, named(lane) + waiting_at(*g));
  }
  return true;
}

// The lane whose value `lane` reads, by CUDA's rules: within its group of
// `width` lanes; __shfl_up/down_sync keep their own value past the group's
// edge, and __shfl_xor_sync past its end.
int source_lane(WarpOp op, int lane, int arg, int width) {
  const int base = lane & ~(width - 1);
  switch (op) {
    case WarpOp::kShfl: return base + (arg & (width - 1));
    case WarpOp::kShflUp: return arg < width && lane - arg >= base ? lane - arg : lane;
    case WarpOp::kShflDown: return arg < width && lane + arg < base + width ? lane + arg : lane;
    case WarpOp::kShflXor: {
      const int src = lane ^ (arg & (kWarpSize - 1));
      return src < base + width ? src : lane;
    }
    default: return lane;
  }
}

// Computes the result of every lane of f's (complete) group and makes them runnable.
void release_group(Runtime& rt, unsigned n, const Fiber& f, std::vector<int>& ready) {
  const unsigned mask = f.mask;
  uint64_t any = 0, all = 1, ballot = 0;
  for (unsigned m = mask; m != 0; m &= m - 1) {
    const int lane = __builtin_ctz(m);
    const bool p = lane_fiber(rt, n, f.warp, lane)->value != 0;
    any |= p;
    all &= p;
    ballot |= static_cast<uint64_t>(p) << lane;
  }
  for (unsigned m = mask; m != 0; m &= m - 1) {
    Fiber& g = *lane_fiber(rt, n, f.warp, __builtin_ctz(m));
    switch (g.op) {
      case WarpOp::kSync: g.result = 0; break;
      case WarpOp::kAny: g.result = any; break;
      case WarpOp::kAll: g.result = all; break;
      case WarpOp::kBallot: g.result = ballot; break;
      default: {
        const int src = source_lane(g.op, g.lane, g.arg, g.width);
        if (((mask >> src) & 1u) == 0) {
          throw warp_fault(rt, g, "it reads lane " + std::to_string(src) + ", which is not in the mask");
        }
        g.result = lane_fiber(rt, n, f.warp, src)->value;
      }
    }
  }
  for (unsigned m = mask; m != 0; m &= m - 1) {
    Fiber& g = *lane_fiber(rt, n, f.warp, __builtin_ctz(m));
    g.state = State::kRunnable;
    ready.push_back(g.index);
  }
}

void release_warps(Runtime& rt, unsigned n, std::vector<int>& ready) {
  for (unsigned i = 0; i < n; ++i) {
    const Fiber& f = *rt.fibers[i];
    if (f.state == State::kAtWarpBarrier && group_complete(rt, n, f)) release_group(rt, n, f, ready);
  }
}

// __syncthreads(): released once every live thread waits there (exited threads count as arrived).
void release_block(Runtime& rt, unsigned n, unsigned live, std::vector<int>& ready) {
  unsigned waiting = 0, count = 0;
  for (unsigned i = 0; i < n; ++i) {
    const Fiber& f = *rt.fibers[i];
    if (f.state != State::kAtBlockBarrier) continue;
    ++waiting;
    count += f.value != 0;
  }
  if (waiting == 0 || waiting != live) return;
  for (unsigned i = 0; i < n; ++i) {
    Fiber& f = *rt.fibers[i];
    if (f.state != State::kAtBlockBarrier) continue;
    switch (f.block_op) {
      case BlockOp::kCount: f.result = count; break;
      case BlockOp::kAnd: f.result = count == waiting; break;
      case BlockOp::kOr: f.result = count > 0; break;
      default: f.result = 0;
    }
    f.state = State::kRunnable;
    ready.push_back(f.index);
  }
}

// No thread can run and no barrier can be released.
[[noreturn]] void deadlock(Runtime& rt, unsigned n) {
  unsigned at_block = 0, at_warp = 0;
  std::string example;
  for (unsigned i = 0; i < n; ++i) {
    const Fiber& f = *rt.fibers[i];
    at_block += f.state == State::kAtBlockBarrier;
    at_warp += f.state == State::kAtWarpBarrier;
    if (f.state != State::kAtWarpBarrier || !example.empty()) continue;
    for (unsigned m = f.mask; m != 0 && example.empty(); m &= m - 1) {
      const Fiber* g = lane_fiber(rt, n, f.warp, __builtin_ctz(m));
      if (g->state != State::kAtWarpBarrier || g->mask != f.mask) {
        example = "; e.g. " + describe(f) + " " + waiting_at(f) + ", but lane " + std::to_string(g->lane) + " " +
                  waiting_at(*g);
      }
    }
  }
  throw std::runtime_error(where(rt) + ": deadlock, no thread can run: " + std::to_string(at_block) +
                           " threads wait at __syncthreads() and " + std::to_string(at_warp) +
                           " at warp operations" + example);
}

void shuffle(std::vector<int>& v, Rng& rng) {
  for (size_t i = v.size(); i > 1; --i) std::swap(v[i - 1], v[rng.below(i)]);
}

// Runs the block whose blockIdx is set, phase by phase.
void run_block(Runtime& rt, unsigned n, Rng& rng, std::vector<int>& ready) {
  start_threads(rt, n);
  ready.resize(n);
  for (unsigned i = 0; i < n; ++i) ready[i] = static_cast<int>(i);
  unsigned live = n;
  for (;;) {
    shuffle(ready, rng);
    for (const int i : ready) {
      Fiber& f = *rt.fibers[i];
      resume(rt, f);
      live -= f.state == State::kExited;
    }
    if (live == 0) return;
    ready.clear();
    release_warps(rt, n, ready);
    release_block(rt, n, live, ready);
    if (ready.empty()) deadlock(rt, n);
  }
}

// ---- launches -----------------------------------------------------------------------

uint64_t seed() {
  const char* env = std::getenv("CNR_CUDA_EMU_SEED");
  if (env == nullptr || *env == '\0') return kDefaultSeed;
  char* end = nullptr;
  const unsigned long long v = std::strtoull(env, &end, 0);
  if (*end != '\0') {
    throw std::invalid_argument(std::string("cnr_emu: CNR_CUDA_EMU_SEED must be an integer, got '") + env + "'");
  }
  return v;
}

// Records what CUDA would report for a launch it refuses; returns whether the launch may run.
bool check_config(Runtime& rt, const LaunchSpec& s) {
  const dim3 b = s.block, g = s.grid;
  const uint64_t threads = static_cast<uint64_t>(b.x) * b.y * b.z;
  std::string why;
  int code = cudaErrorInvalidConfiguration;
  if (threads == 0 || threads > 1024 || b.x > 1024 || b.y > 1024 || b.z > 64) {
    why = "block " + triple(b) + ": a block holds 1 to 1024 threads (x and y at most 1024, z at most 64)";
  } else if (g.x == 0 || g.y == 0 || g.z == 0 || g.x > 0x7fffffffu || g.y > 65535 || g.z > 65535) {
    why = "grid " + triple(g) + ": grid.x must be in [1, 2^31 - 1], grid.y and grid.z in [1, 65535]";
  } else if (s.shared_bytes > 48 * 1024) {
    why = std::to_string(s.shared_bytes) + " bytes of dynamic shared memory: at most 48 KiB without an opt-in";
    code = cudaErrorInvalidValue;
  } else {
    return true;
  }
  rt.error_code = code;
  rt.error_message = std::string("CUDA error: ") + error_string(code) + " (cnr_emu: kernel " + s.kernel +
                     " launched with " + why + ")";
  return false;
}

}  // namespace

void launch(const LaunchSpec& spec, void (*thread_main)(void*), void* ctx) {
  Runtime& rt = runtime();
  if (rt.current != nullptr) fault("a kernel launched a kernel; dynamic parallelism is not emulated");
  if (!check_config(rt, spec)) return;
  Rng rng(seed());
  struct Active {  // the launch's state is cleared however it ends
    Runtime& rt;
    ~Active() {
      rt.spec = nullptr;
      rt.thread_main = nullptr;
      rt.ctx = nullptr;
      rt.current = nullptr;
      rt.fault.clear();
    }
  } active{rt};
  rt.spec = &spec;
  rt.thread_main = thread_main;
  rt.ctx = ctx;
  rt.fast_switch = Context::fast_switch();
  blockDim = spec.block;
  gridDim = spec.grid;
  const dim3 g = spec.grid;
  const unsigned threads = spec.block.x * spec.block.y * spec.block.z;
  const uint64_t blocks = static_cast<uint64_t>(g.x) * g.y * g.z;
  // Blocks in a random order: i -> (a * i + c) mod blocks is a permutation when a and blocks are coprime.
  uint64_t a = 1, c = 0;
  if (blocks > 1) {
    do {
      a = 1 + rng.below(blocks - 1);
    } while (std::gcd(a, blocks) != 1);
    c = rng.below(blocks);
  }
  std::vector<int> ready;
  for (uint64_t i = 0; i < blocks; ++i) {
    const uint64_t k = static_cast<uint64_t>((static_cast<unsigned __int128>(a) * i + c) % blocks);
    blockIdx = {static_cast<unsigned>(k % g.x), static_cast<unsigned>((k / g.x) % g.y),
                static_cast<unsigned>(k / (static_cast<uint64_t>(g.x) * g.y))};
    run_block(rt, threads, rng, ready);
  }
}

void check_launch() {
  Runtime& rt = runtime();
  if (rt.error_code == 0) return;
  const std::string message = std::move(rt.error_message);
  rt.error_code = 0;
  rt.error_message.clear();
  throw std::runtime_error(message);
}

int peek_error() { return runtime().error_code; }

int take_error() {
  Runtime& rt = runtime();
  const int code = rt.error_code;
  rt.error_code = 0;
  rt.error_message.clear();
  return code;
}

const char* error_string(int code) {
  switch (code) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorInvalidConfiguration: return "invalid configuration argument";
    default: return "unspecified launch failure";
  }
}

// ---- device side ----------------------------------------------------------------------

int block_barrier(BlockOp op, int predicate) {
  Runtime& rt = runtime();
  Fiber& self = calling_thread(rt, "__syncthreads()");
  self.block_op = op;
  self.value = predicate != 0;
  park(rt, State::kAtBlockBarrier);
  return static_cast<int>(self.result);
}

uint64_t warp_barrier(WarpOp op, unsigned mask, uint64_t value, int arg, int width) {
  Runtime& rt = runtime();
  Fiber& self = calling_thread(rt, op_name(op));
  // The messages go through a buffer: fault() never returns, so a std::string here would never be freed.
  char why[160];
  if (((mask >> self.lane) & 1u) == 0) {
    std::snprintf(why, sizeof why, "%s with mask 0x%08x from lane %d, which is not in the mask", op_name(op), mask,
                  self.lane);
    fault(why);
  }
  if (width < 1 || width > kWarpSize || (width & (width - 1)) != 0) {
    std::snprintf(why, sizeof why, "%s with width %d; it must be a power of two up to 32", op_name(op), width);
    fault(why);
  }
  self.op = op;
  self.mask = mask;
  self.value = value;
  self.arg = arg;
  self.width = width;
  park(rt, State::kAtWarpBarrier);
  return self.result;
}

void fault(const char* what) {
  Runtime& rt = runtime();
  if (rt.current == nullptr) throw std::runtime_error(std::string("cnr_emu: ") + what);
  rt.fault = where(rt) + ", " + describe(*rt.current) + ": " + what;
  park(rt, State::kFaulted);
  std::abort();  // a faulted thread is never resumed
}

}  // namespace cnr_emu
