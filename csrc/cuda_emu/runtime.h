// The runtime of the CUDA emulation: what the shim <cuda_runtime.h> needs to run
// a kernel's grid on the calling host thread (implemented in runtime.cpp).
//
// A launch runs every block of the grid, one block at a time, and each block's
// threads as fibers on that host thread. A thread runs until it reaches a
// barrier (__syncthreads) or a warp-synchronous operation (__shfl*_sync,
// __syncwarp, __any_sync, ...), exits, or faults; when no thread can run, the
// barriers whose participants have all arrived are released. Threads, and the
// blocks, run in a pseudo-random order drawn from CNR_CUDA_EMU_SEED, so a kernel
// that relies on an order CUDA does not promise gives seed-dependent results.
//
// Kernels must not own resources (device code cannot): a faulting block is
// abandoned where its threads stand, without unwinding their stacks.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <type_traits>
#include <utility>

// CUDA's vector types of the builtin variables.
struct uint3 {
  unsigned int x, y, z;
};

struct dim3 {
  unsigned int x, y, z;
  constexpr dim3(unsigned int vx = 1, unsigned int vy = 1, unsigned int vz = 1) : x(vx), y(vy), z(vz) {}
  constexpr dim3(uint3 v) : x(v.x), y(v.y), z(v.z) {}  // NOLINT: implicit, as in CUDA
  constexpr operator uint3() const { return {x, y, z}; }
};

// The builtin variables, per host thread: the scheduler sets them before it
// resumes any emulated thread. Constant-initialized, so reading them costs no
// TLS initialization check.
inline thread_local uint3 threadIdx{0, 0, 0};
inline thread_local uint3 blockIdx{0, 0, 0};
inline thread_local dim3 blockDim{1, 1, 1};
inline thread_local dim3 gridDim{1, 1, 1};
constexpr int warpSize = 32;

namespace cnr_emu {

// What one launch asks for.
struct LaunchSpec {
  const char* kernel;    // the kernel's name, for error messages
  dim3 grid, block;
  size_t shared_bytes;   // dynamic shared memory (not emulated: only checked against CUDA's limit)
};

// Runs `thread_main(ctx)` once per thread of the grid. A bad configuration is
// recorded for check_launch() and nothing runs, as on CUDA. A fault inside the
// kernel (deadlock, a warp operation whose lanes do not all take part) throws
// std::runtime_error here, and the runtime stays usable.
void launch(const LaunchSpec& spec, void (*thread_main)(void*), void* ctx);

// Throws the error of the last failed launch on this host thread, if any, and
// clears it (what C10_CUDA_KERNEL_LAUNCH_CHECK does with cudaGetLastError()).
void check_launch();

// The pending launch error's code and message, cleared by take_error(): what
// cudaGetLastError() / cudaPeekAtLastError() report.
int peek_error();
int take_error();
const char* error_string(int code);

// ---- called by the emulated threads (device side) --------------------------

// __syncthreads and its reducing variants: every live thread of the block
// arrives, then all leave with the reduction of the predicates.
enum class BlockOp : int { kSync, kCount, kAnd, kOr };
int block_barrier(BlockOp op, int predicate);

// A warp-synchronous operation: every lane named in `mask` (the caller's own
// lane included) arrives with the same op and mask, then each leaves with its
// result. `arg` is the source lane, delta or lane mask of a shuffle; `value`
// carries the shuffled bits or the predicate.
enum class WarpOp : int { kSync, kShfl, kShflUp, kShflDown, kShflXor, kAny, kAll, kBallot };
uint64_t warp_barrier(WarpOp op, unsigned mask, uint64_t value, int arg, int width);

// Ends the calling block with an error (a trap, or misuse found in the thread).
[[noreturn]] void fault(const char* what);

// ---- CNR_LAUNCH --------------------------------------------------------------

template <typename T>
inline uint64_t to_bits(T v) {
  static_assert(std::is_trivially_copyable_v<T> && sizeof(T) <= sizeof(uint64_t), "shuffles move up to 8 bytes");
  uint64_t bits = 0;
  std::memcpy(&bits, &v, sizeof(T));
  return bits;
}

template <typename T>
inline T from_bits(uint64_t bits) {
  T v;
  std::memcpy(&v, &bits, sizeof(T));
  return v;
}

// CNR_LAUNCH(kernel, grid, block, shared, stream) builds one of these from a
// generic lambda that calls the kernel, so that a kernel template deduces its
// arguments from the call as it does under nvcc; calling it runs the grid.
template <typename Body>
class Launcher {
 public:
  Launcher(const char* kernel, dim3 grid, dim3 block, size_t shared_bytes, void* /*stream*/, Body body)
      : spec_{kernel, grid, block, shared_bytes}, body_(body) {}

  template <typename... Args>
  void operator()(Args&&... args) const {
    // The parameters are copied once, as CUDA copies them into the launch's
    // parameter space; the lambda takes its own copy for every thread.
    using Params = std::tuple<std::decay_t<Args>...>;
    const Params params(std::forward<Args>(args)...);
    struct Call {
      const Body* body;
      const Params* params;
      static void run(void* self) {
        const auto* call = static_cast<const Call*>(self);
        std::apply(*call->body, *call->params);
      }
    } call{&body_, &params};
    launch(spec_, &Call::run, &call);
  }

 private:
  LaunchSpec spec_;
  Body body_;
};

template <typename Body>
Launcher(const char*, dim3, dim3, size_t, void*, Body) -> Launcher<Body>;

}  // namespace cnr_emu
