// Memory-ordering primitives and the timed cross-rank barrier of the intranode kernels (the 64-bit flags also serve
// the NVSHMEM engines).
//
// Ranks signal each other through int flags in each other's CUDA-IPC buffers. A flag store is a system-scope
// release (everything this rank wrote before it, to any GPU, is visible before the flag), a flag load is a
// system-scope acquire. Every wait gives up after `timeout_ns` and reports rank, peer and stage, then traps so
// the host sees a CUDA error instead of hanging forever.
#pragma once

#include <cstdint>
#include <cstdio>

#include "stages.h"

namespace ep::sync {

__device__ __forceinline__ void store_release_sys(int* ptr, int value) {
    asm volatile("st.release.sys.global.s32 [%0], %1;" ::"l"(ptr), "r"(value) : "memory");
}

__device__ __forceinline__ int load_acquire_sys(const int* ptr) {
    int value;
    asm volatile("ld.acquire.sys.global.s32 %0, [%1];" : "=r"(value) : "l"(ptr) : "memory");
    return value;
}

// 64-bit flags (the NVSHMEM engines' epoch-tagged signals).
__device__ __forceinline__ void store_release_sys(uint64_t* ptr, uint64_t value) {
    asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(ptr), "l"(value) : "memory");
}

__device__ __forceinline__ uint64_t load_acquire_sys(const uint64_t* ptr) {
    uint64_t value;
    asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(value) : "l"(ptr) : "memory");
    return value;
}

// A load that always goes to memory (peers' buffers are written by other GPUs/processes; L1 is not coherent).
__device__ __forceinline__ int load_relaxed_sys(const int* ptr) {
    int value;
    asm volatile("ld.relaxed.sys.global.s32 %0, [%1];" : "=r"(value) : "l"(ptr) : "memory");
    return value;
}

__device__ __forceinline__ uint64_t global_timer_ns() {
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}


__device__ __forceinline__ const char* stage_name(int stage) {
    switch (stage) {
        case kStageNotifyCounts: return "notify: waiting for peers' counts";
        case kStageDispatchData: return "dispatch: waiting for peers' token writes";
        case kStageCombineReady: return "combine: waiting for peers to be ready to receive";
        case kStageCombineData: return "combine: waiting for peers' expert outputs";
        case kStageDispatchReady: return "dispatch: waiting for peers' receive offsets";
        case kStageCombineDone: return "combine: waiting for peers to finish reading this rank's expert outputs";
        case kStageInternodeNotify: return "notify: waiting for the peer's counts";
        case kStageInternodeDispatchStart: return "cached dispatch: waiting for the peer to finish its previous call";
        case kStageInternodeDispatchSent: return "dispatch: waiting for the peer's RDMA puts";
        case kStageInternodeDispatchForwarded: return "dispatch: waiting for the peer's NVLink forwarding";
        case kStageInternodeCombineStart: return "combine: waiting for the peer to finish its previous call";
        case kStageInternodeCombineNvl: return "combine: waiting for the peer's expert outputs (NVLink leg)";
        case kStageInternodeCombineRdma: return "combine: waiting for the peer's node partials (RDMA leg)";
        default: return "unknown stage";
    }
}

// Barrier over `num_ranks` ranks, run by one block (thread r talks to rank r; needs blockDim.x >= num_ranks).
// peer_flags[r] points at rank r's flag array; this rank's arrival at epoch e is peer_flags[r][rank] = e.
// Epochs only grow, so flags never need resetting (also across CUDA-graph replays: the epoch lives on the device).
__device__ __forceinline__ void block_barrier(int* const* peer_flags, int* my_flags, int* epoch, int rank, int num_ranks,
                                              int64_t timeout_ns, int stage) {
    __shared__ int next_epoch;
    __syncthreads();
    if (threadIdx.x == 0) next_epoch = *epoch + 1;
    __syncthreads();
    const int e = next_epoch;
    if (threadIdx.x < num_ranks) {
        __threadfence_system();  // this rank's earlier writes (this kernel and earlier ones) before the flag
        store_release_sys(peer_flags[threadIdx.x] + rank, e);
        const uint64_t start = global_timer_ns();
        while (load_acquire_sys(my_flags + threadIdx.x) < e) {
            if (global_timer_ns() - start > static_cast<uint64_t>(timeout_ns)) {
                printf("ep_dispatcher: timeout after %lld ms on rank %d waiting for peer %d, stage '%s' (epoch %d)\n",
                       static_cast<long long>(timeout_ns / 1000000), rank, static_cast<int>(threadIdx.x), stage_name(stage), e);
                asm volatile("trap;");
            }
        }
    }
    __syncthreads();
    if (threadIdx.x == 0) *epoch = e;
    __syncthreads();
}

}  // namespace ep::sync
