// Shared host/device helpers for every kernel family: error reporting, grid sizing and alignment arithmetic (the
// constants themselves are in constants.h). Kept free of torch headers so that kernels and runtime code can include it
// cheaply.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <sstream>
#include <stdexcept>
#include <string>

#include "constants.h"

namespace ep {

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

// Grid of a data kernel that gives each work item (token, row) one warp of a kDataThreadsPerBlock block: enough blocks
// for every item, at most num_sms, at least one.
inline int data_grid(int num_sms, int64_t work_items) {
    const int64_t needed = ceil_div<int64_t>(std::max<int64_t>(work_items, 1), kDataWarpsPerBlock);
    return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(num_sms, needed)));
}

}  // namespace ep
