// Shared host/device helpers for every kernel family: error reporting and launch constants.
// Kept free of torch headers so that kernels and runtime code can include it cheaply.
#pragma once

#include <cuda_runtime.h>

#include <sstream>
#include <stdexcept>
#include <string>

namespace ep {

// Threads per block for the bookkeeping kernels (layout, notify): 8 warps give each SM enough loads in
// flight to hide global-memory latency, while a block's shared counters and __syncthreads stay cheap.
constexpr int kNumThreadsPerBlock = 256;

// Thrown by EP_HOST_ASSERT / EP_CUDA_CHECK. It derives from std::runtime_error, which pybind11 turns into
// Python's RuntimeError with the message intact.
class HostError : public std::runtime_error {
   public:
    using std::runtime_error::runtime_error;
};

namespace detail {

// Builds "file:line: <what>" from a stream of message parts; out of line of the fast path (only called on failure).
template <typename... Args>
[[noreturn]] __host__ void throw_host_error(const char* file, int line, const char* what, const Args&... args) {
    std::ostringstream message;
    message << file << ":" << line << ": " << what;
    if constexpr (sizeof...(Args) > 0) {
        message << ": ";
        (message << ... << args);
    }
    throw HostError(message.str());
}

}  // namespace detail
}  // namespace ep

// Host-side invariant check. Usage: EP_HOST_ASSERT(n >= 0, "num_tokens must be >= 0, got ", n);
// The message carries file:line, the failed condition and the caller's context.
#define EP_HOST_ASSERT(cond, ...)                                                                          \
    do {                                                                                                   \
        if (!(cond)) {                                                                                     \
            ::ep::detail::throw_host_error(__FILE__, __LINE__, "check `" #cond "` failed", ##__VA_ARGS__); \
        }                                                                                                  \
    } while (0)

// Checks a CUDA runtime call; reports the call, file:line, the error name and cudaGetErrorString's text.
// Used right after kernel launches too (EP_CUDA_CHECK(cudaGetLastError())), which does not synchronise.
#define EP_CUDA_CHECK(call)                                                                                                             \
    do {                                                                                                                                \
        const cudaError_t ep_cuda_status_ = (call);                                                                                     \
        if (ep_cuda_status_ != cudaSuccess) {                                                                                           \
            ::ep::detail::throw_host_error(__FILE__, __LINE__, "CUDA call `" #call "` failed", cudaGetErrorName(ep_cuda_status_), ": ", \
                                           cudaGetErrorString(ep_cuda_status_));                                                        \
        }                                                                                                                               \
    } while (0)

namespace ep {

// Integer ceiling division for grid sizing.
template <typename T>
__host__ __device__ constexpr T ceil_div(T a, T b) {
    return (a + b - 1) / b;
}

// Rounds `value` up to a multiple of `alignment` (buffer region offsets).
__host__ __device__ constexpr int64_t align_up(int64_t value, int64_t alignment) { return (value + alignment - 1) / alignment * alignment; }

}  // namespace ep
