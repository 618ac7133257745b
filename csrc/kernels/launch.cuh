// Chained kernel launches (programmatic dependent launch, sm_90): a kernel launched chained may be scheduled while the
// kernel ahead of it in the stream still runs, so its launch latency hides behind that kernel's tail instead of adding
// a gap between them. Every kernel that can be launched chained calls wait_for_previous_kernel() before it touches
// memory (it returns once the kernel ahead has finished and its writes are visible), then let_next_kernel_start().
//
// Only where no kernel of the chain waits for a peer: blocks scheduled early sit resident until the kernel ahead ends,
// and with several ranks on one GPU (MPS) a large grid parked that way could take the SMs a peer's kernel needs before
// this rank's barrier can pass. Callers chain when the group has one rank (see chained_launch_for).
#pragma once

#include <cuda_runtime.h>

#include <cstdlib>
#include <string>

#include "common.cuh"

namespace ep {

__device__ __forceinline__ void wait_for_previous_kernel() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// The next chained kernel may be scheduled once every block of this one has called this (or exited).
__device__ __forceinline__ void let_next_kernel_start() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Whether a group of `num_ranks` ranks launches its kernels chained: one rank has no peer to starve.
// EP_DISPATCHER_CHAINED_LAUNCH=0 turns chaining off (to measure what it is worth, or on a platform that misbehaves).
inline bool chained_launch_for(int num_ranks) {
    static const bool enabled = [] {
        const char* value = std::getenv("EP_DISPATCHER_CHAINED_LAUNCH");
        return value == nullptr || std::string(value) != "0";
    }();
    return enabled && num_ranks == 1;
}

// kernel<<<grid, block, shared, stream>>>(args...), chained to the kernel ahead when `chained`; checks the launch.
template <typename... Params, typename... Args>
void launch_kernel(bool chained, void (*kernel)(Params...), dim3 grid, dim3 block, size_t shared, cudaStream_t stream,
                   const Args&... args) {
    cudaLaunchAttribute attribute{};
    attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attribute.val.programmaticStreamSerializationAllowed = 1;
    cudaLaunchConfig_t config{};
    config.gridDim = grid;
    config.blockDim = block;
    config.dynamicSmemBytes = shared;
    config.stream = stream;
    config.attrs = &attribute;
    // A platform that refuses chained launches (the first refusal is remembered) gets ordinary ones.
    static bool chaining_refused = false;
    config.numAttrs = chained && !chaining_refused ? 1 : 0;
    cudaError_t status = cudaLaunchKernelEx(&config, kernel, args...);
    if (status == cudaErrorNotSupported && config.numAttrs == 1) {
        (void)cudaGetLastError();
        chaining_refused = true;
        config.numAttrs = 0;
        status = cudaLaunchKernelEx(&config, kernel, args...);
    }
    EP_CUDA_CHECK(status);
}

}  // namespace ep
