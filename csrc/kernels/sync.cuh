// Memory-ordering primitives and the one timed wait of every engine (intranode, internode, low latency), with the
// stage names its timeout report prints; also the timed cross-rank barrier of the intranode kernels.
//
// Ranks signal each other through flags in each other's buffers (CUDA-IPC mappings, NVSHMEM symmetric memory). A flag
// store is a system-scope release (everything this rank wrote before it, to any GPU, is visible before the flag), a
// flag load is a system-scope acquire. Every wait (timed_wait) gives up after `timeout_ns` and reports rank, peer and
// stage, then traps so the host sees a CUDA error instead of hanging forever.
#pragma once

#include <cstdint>
#include <cstdio>

#include "stages.h"
#include "../runtime/timeout_record.h"

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

// The same at GPU scope: enough where only this GPU reads the flag (a rank signalling itself).
__device__ __forceinline__ void store_release_gpu(uint64_t* ptr, uint64_t value) {
    asm volatile("st.release.gpu.global.u64 [%0], %1;" ::"l"(ptr), "l"(value) : "memory");
}

__device__ __forceinline__ uint64_t load_acquire_sys(const uint64_t* ptr) {
    uint64_t value;
    asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(value) : "l"(ptr) : "memory");
    return value;
}

// A release/acquire fence at system scope: orders this thread's earlier accesses (and, cumulatively, those it has
// observed, e.g. its block's through a preceding __syncthreads) before its later ones, for every GPU and the host.
// Cheaper than __threadfence_system (fence.sc.sys), which also orders against other SC fences: no protocol here
// needs that.
__device__ __forceinline__ void fence_acq_rel_sys() { asm volatile("fence.acq_rel.sys;" ::: "memory"); }
// The same at GPU scope: enough where only this GPU reads what the fence orders.
__device__ __forceinline__ void fence_acq_rel_gpu() { asm volatile("fence.acq_rel.gpu;" ::: "memory"); }

// Called by every thread of every block at the end of its work: true in the last block to arrive. The barrier puts
// the block's writes (peer stores included) before thread 0's release fence and arrival; the last block's thread 0
// acquires every arrival, and its barrier passes that on, so all blocks' writes are ordered before whatever the last
// block does next. One acq_rel fence per block on each side, as a grid barrier does (a fence in every thread cost
// microseconds per kernel), at system scope when the last block signals other GPUs or processes, else at GPU scope.
// The counter is reset for the next kernel that uses it (stream order: it starts after this one ends).
template <bool kSystemScope>
__device__ __forceinline__ bool arrive_last(unsigned int* counter) {
    __shared__ bool is_last;
    __syncthreads();
    if (threadIdx.x == 0) {
        kSystemScope ? fence_acq_rel_sys() : fence_acq_rel_gpu();
        is_last = atomicAdd(counter, 1u) == gridDim.x - 1;
        if (is_last) {
            *counter = 0;
            kSystemScope ? fence_acq_rel_sys() : fence_acq_rel_gpu();
        }
    }
    __syncthreads();
    return is_last;
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

// Who waits for whom, for a timeout report (besides the stage and the epoch).
struct WaitSite {
    int stage;        // Stage: what is awaited
    int rank;         // the waiting rank
    int peer;         // the rank whose signal is awaited
    int node = -1;    // internode: the waiting rank's node
    int expert = -1;  // low latency: the expert whose signal it is (-1: an ack, no expert)
    int half = -1;    // low latency: the buffer half
};

// This kernel file's pointer to the process's timeout record (runtime/timeout_record.h), and whether a wait of this
// file already filled it: the first report wins, later ones only print. Static: each kernel file has its own copy,
// which its installer (registered at static initialisation) sets.
static __device__ TimeoutRecord* g_timeout_record = nullptr;
static __device__ int g_timeout_recorded = 0;
namespace {
cudaError_t install_timeout_record_in_this_file(TimeoutRecord* record) {
    return cudaMemcpyToSymbol(g_timeout_record, &record, sizeof(record));
}
[[maybe_unused]] const bool timeout_record_installer_registered = register_timeout_record_installer(&install_timeout_record_in_this_file);
}  // namespace

// Leaves the report where the host finds it after the trap (the printf buffer may be lost with the context).
__device__ __forceinline__ void record_timeout(const WaitSite& site, long long timeout_ms, unsigned long long epoch,
                                               unsigned long long have) {
    TimeoutRecord* record = g_timeout_record;
    if (record == nullptr || atomicCAS(&g_timeout_recorded, 0, 1) != 0 || record->ready != 0) return;
    record->stage = site.stage;
    record->rank = site.rank;
    record->peer = site.peer;
    record->node = site.node;
    record->expert = site.expert;
    record->half = site.half;
    record->timeout_ms = timeout_ms;
    record->epoch = epoch;
    record->have = have;
    __threadfence_system();
    store_release_sys(&record->ready, 1);
}

// The timeout report: one line naming timeout, rank, peer, stage, the epoch awaited and the value last seen, in the
// words of the stage's engine (internode ranks also name their node; low-latency waits their expert and half, and
// compare the upper 32 bits of a signal with the low 32 bits of the epoch).
__device__ __forceinline__ void report_timeout(const WaitSite& site, int64_t timeout_ns, unsigned long long epoch,
                                               unsigned long long have) {
    const long long ms = static_cast<long long>(timeout_ns / 1000000);
    record_timeout(site, ms, epoch, have);
    switch (stage_engine(site.stage)) {
        case Engine::kIntranode:
            printf("ep_dispatcher: timeout after %lld ms on rank %d waiting for peer %d, stage '%s' (epoch %llu, have %llu)\n", ms,
                   site.rank, site.peer, stage_name(site.stage), epoch, have);
            break;
        case Engine::kInternode:
            printf("ep_dispatcher: timeout after %lld ms on rank %d (node %d) waiting for rank %d, internode stage '%s' (epoch %llu, "
                   "have %llu)\n",
                   ms, site.rank, site.node, site.peer, stage_name(site.stage), epoch, have);
            break;
        case Engine::kLowLatency:
            printf("ep_dispatcher: timeout after %lld ms on rank %d waiting for rank %d, expert %d, low-latency stage '%s' (buffer half "
                   "%d, epoch %llu, have %llu)\n",
                   ms, site.rank, site.peer, site.expert, stage_name(site.stage), site.half, epoch & 0xffffffffull, have >> 32);
            break;
    }
}

// Spins until ready(load_acquire_sys(flag)) holds and returns the value that passed; `epoch` (what the flag must
// reach) only feeds the report. After `timeout_ns` it prints report_timeout's line and traps.
template <typename T, typename Ready>
__device__ __forceinline__ T timed_wait(const T* flag, Ready&& ready, int64_t timeout_ns, unsigned long long epoch, const WaitSite& site) {
    const uint64_t start = global_timer_ns();
    while (true) {
        const T value = load_acquire_sys(flag);
        if (ready(value)) return value;
        if (global_timer_ns() - start > static_cast<uint64_t>(timeout_ns)) {
            report_timeout(site, timeout_ns, epoch, static_cast<unsigned long long>(value));
            asm volatile("trap;");
        }
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
    // One rank has no peer to meet: stream order already puts its earlier kernels' writes before its later ones, so the
    // system-scope fence and the wait on its own flag would only cost time.
    if (threadIdx.x < num_ranks && num_ranks > 1) {
        const int peer = static_cast<int>(threadIdx.x);
        __threadfence_system();  // this rank's earlier writes (this kernel and earlier ones) before the flag
        store_release_sys(peer_flags[peer] + rank, e);
        timed_wait(my_flags + peer, [e](int flag) { return flag >= e; }, timeout_ns, static_cast<unsigned long long>(e),
                   WaitSite{stage, rank, peer});
    }
    __syncthreads();
    if (threadIdx.x == 0) *epoch = e;
    __syncthreads();
}

}  // namespace ep::sync
