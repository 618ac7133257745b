// Low-latency (decode) kernels over NVSHMEM symmetric memory.
//
// Buffer: two halves (calls alternate between them, so one call's receive can overlap the next call's send).
// Each half, inside the symmetric allocation, at the same offset on every rank:
//   send   : dispatch: one staged message per token, only for peers reached by NVSHMEM puts (a put reads symmetric
//            memory); combine: the [E_local, R * T, H] bf16 expert outputs (the zero-copy buffer), which directly
//            addressable sources read in place, and the source of the puts to the others.
//   recv   : dispatch: [E_local][R][T] messages, one region per (local expert, source rank), so senders never
//            contend for slots; combine: [E][T] bf16 rows pushed by ranks that are not directly addressable,
//            expert-major, at the slot the source chose in dispatch.
//   signal : dispatch counts [E_local][R], combine flags [E], receive acks [R] (all uint64).
// Signals carry the half's epoch (calls of that half so far + 1) in their upper 32 bits, so they never need
// resetting; the lower 32 bits carry a dispatch count, or in a combine flag the first slot of the source's range at
// that expert. After a rank has read a half (its own receive area, or a peer's send area) it acks every peer, and a
// rank waits for those acks before writing into a half again: a rank that runs a call ahead cannot overwrite data a
// slower rank has not read yet.
//
// Work is spread over every block the rank may use (max_blocks, below), never one warp per expert:
//   dispatch send = one kernel. Each block takes a contiguous range of (token, 512-channel step) items and first plans
//     its own tokens in shared memory (each entry's slot = its rank among this rank's entries for that expert, in
//     token order; per-expert counts; bad ids reported and skipped), then a warp per item reads the row once, casts
//     it to FP8 once and stores it straight into its slot at each of the token's experts; the last block to finish
//     signals every expert's count.
//   dispatch receive = every block waits for the counts, then a warp per received message copies it to its packed
//     place (source ranks ascending, token order inside a source). One rank alone sends straight into those places
//     (DirectReceive), and its receive kernel only publishes the counts and ranges.
//   combine send = moves no row for directly addressable sources with the zero-copy buffer (else a warp per (row,
//     4 KB chunk) copies `x` into the send area, and pushes the rows of the other sources); the last block flags every
//     (expert, source) pair. combine receive = waits for the flags, then reads each row where it is (the expert's
//     rank's send area, or its own receive area) and sums in fp32, k ascending: each expert output crosses memory
//     once on its way to the sum.
// Ordering is therefore deterministic and matches the reference backend bit for bit.
//
// Content errors (an expert id outside [-1, E), an expert listed twice by a token) never stop a kernel: the entry is
// skipped and one 8-byte record is stored into host-mapped memory, which the host reads without a sync after its
// next low-latency launch (ep_dispatcher.buffer raises ValueError there).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "constants.h"

namespace ep::low_latency {

constexpr int kHeaderBytes = 16;  // a message's header: source token index (int32) + padding to 16 bytes
constexpr int kMaxRanks = 1024;                      // shared-memory prefix arrays in the receive kernels
constexpr int kMaxPrefixSharedBytes = 48 * 1024;     // their size (and the send plan's): the default dynamic shared-memory limit

// The error record (one uint64 in host-mapped memory, written by a single store so it is never torn):
// bits 60..63 code, 56..59 k, 32..55 token (clamped), 0..31 the bad value (int32, clamped).
enum ErrorCode : uint32_t {
    kErrorNone = 0,
    kErrorDispatchRange = 1,   // dispatch: topk_idx entry outside [-1, num_experts)
    kErrorDispatchRepeat = 2,  // dispatch: a token lists the same expert twice (value = the expert)
    kErrorCombineRange = 3,    // combine: topk_idx entry outside [-1, num_experts)
};
constexpr int kErrorCodeShift = 60, kErrorKShift = 56, kErrorTokenShift = 32;
constexpr uint64_t kErrorKMask = 0xf, kErrorTokenMask = 0xffffff;

struct Layout {
    int num_ranks, num_experts, num_local_experts, max_tokens, hidden;
    int64_t dispatch_msg_bytes;  // header + max(BF16 row, FP8 row + fp32 scales), 16-byte aligned
    int64_t send_bytes, recv_bytes, signal_bytes, half_bytes;  // each 128-byte aligned
    // Offsets from the start of a half.
    __host__ __device__ int64_t send_offset() const { return 0; }
    __host__ __device__ int64_t recv_offset() const { return send_bytes; }
    __host__ __device__ int64_t dispatch_signal_offset() const { return send_bytes + recv_bytes; }
    __host__ __device__ int64_t combine_signal_offset() const { return dispatch_signal_offset() + int64_t(num_experts) * 8; }
    __host__ __device__ int64_t ack_offset() const { return combine_signal_offset() + int64_t(num_experts) * 8; }
};

// The one source of these sizes: Buffer.get_low_latency_rdma_size_hint is 2 * half_bytes through _C.low_latency_layout;
// the reference backend's copy of the arithmetic (backends/reference_layout.py) serves only without the extension.
Layout make_layout(int num_ranks, int num_experts, int max_tokens, int hidden);

// Per-Buffer device state outside the symmetric heap: epochs and the block-arrival counters (the last block of a
// send kernel signals, the last block of a receive kernel acks; per half, as the halves' calls may overlap).
struct State {
    unsigned long long epoch[2];
    unsigned int arrived[2];       // receive kernels
    unsigned int send_arrived[2];  // send kernels
};

// Pointers the kernels need for one half of the buffer.
struct Half {
    uint8_t* local;            // this rank's half (symmetric address: also valid as a put target for any PE)
    const int64_t* peer_base;  // device [R]: start of the peer's whole buffer, directly addressable (NVLink/P2P), or 0 -> NVSHMEM put
    int64_t half_offset;       // bytes from the buffer's start to this half (peer address = peer_base + half_offset + offset)
    int half;                  // 0 or 1
    int rank;
    // Upper bound on every kernel's grid, in 512-thread blocks (the small-block kernels launch 4x as many 128-thread
    // blocks). The kernels spin on peers' signals, so when several ranks share one GPU (MPS) all their blocks must be
    // resident at once: the bound is SMs / ranks on the GPU. With one rank per GPU it is the SM count.
    int max_blocks;
    State* state;
    int64_t timeout_ns;
    unsigned long long* error;  // device address of the host-mapped error record
    // Phase timestamps for profiling (null: off; profile_low_latency.py --phase-trace): thread 0 of each block writes
    // the global timer (ns) at each point of its kernel, [kernel][block][point] (see TracePoint); blocks past
    // kTraceBlocks are not traced. Each call overwrites the previous call's stamps of the same kernel.
    unsigned long long* phase_trace;
};

// The traced kernels and their points, in order (a block that is not the last to arrive ends at kTraceArrived).
enum TraceKernel : int { kTraceSend = 0, kTraceReceive = 1, kTraceCombineSend = 2, kTraceReduce = 3, kTraceKernels = 4 };
enum TracePoint : int {
    kTraceStart = 0,    // after the wait for the kernel ahead
    kTracePrepared = 1, // send: the plan; combine send: the acks; receive / reduce: every count or flag seen
    kTraceWaited = 2,   // send: the acks; combine send: the prefixes; receive / reduce: = kTracePrepared
    kTraceMoved = 3,    // the block's rows moved (or summed)
    kTraceArrived = 4,  // past the block's arrival (fence + counter)
    kTraceSignaled = 5, // the last block: every signal or ack sent
    kTracePoints = 6
};
constexpr int kTraceBlocks = 1024;
constexpr int64_t kTraceInts = int64_t(kTraceKernels) * kTraceBlocks * kTracePoints;

// The dispatch's receive outputs. `wait_stats` (optional, int64 [R], accumulated): the SM clock cycles (clock64) the
// receive spun waiting for each source rank's signals, one add per waited signal: dispatch per (local expert, source
// rank) count, combine per expert flag (added to the rank that holds the expert). DeepEP's
// dispatch/combine_wait_recv_cost_stats. `cumulative_stats` (optional, int32 [E_local]) accumulates the counts.
struct ReceiveOutputs {
    void* recv_x;
    void* recv_scales;  // FP8: fp32 [E_local, groups, R * T], or with UE8M0 int32 [E_local, groups / 4, R * T]
    int* src_info;      // [E_local, R * T]
    int64_t* layout_range;  // [E_local, R]
    int* recv_count;        // [E_local]
    int* cumulative_stats;
    int64_t* wait_stats;
};

// The dispatch's outputs, which one rank alone (num_ranks == 1) fills from its send kernel: every slot's packed place
// is known there (a lone source's range at each expert starts at 0), so the rows land in recv_x straight from the
// cast, and the receive kernel moves no row. Ignored with more than one rank.
struct DirectReceive {
    ReceiveOutputs outputs;  // recv_x, recv_scales and src_info; the rest only with `publish`
    bool use_ue8m0;
    bool publish;  // one_rank_fused: the send kernel also writes the counts, ranges and stats, and ends the call
};

// One rank alone with the pending kernels (EP_DISPATCHER_PENDING_KERNELS=1, kernels/pending_kernels.h): one kernel per
// dispatch and one per zero-copy combine. The dispatch's send kernel also does what its receive kernel did (counts,
// ranges and cumulative stats from its plan's totals, unused slots marked, the half's epoch and ack), and dispatch_recv
// launches nothing. A zero-copy combine's send launches nothing (no row moves, and there is no peer to flag), and the
// reduce reads the rows where the experts wrote them, from slot 0 (a lone source's range), after the ack of the half's
// previous use, which the combine send used to wait for. Each saves a launch and a kernel boundary per call.
bool one_rank_fused(const Layout& layout);

// `send_slot`: int32 [num_tokens * num_topk]: each entry's slot at its expert (-1: skipped), which the combine reads.
// `direct`: the outputs when layout.num_ranks == 1 (else ignored). `all_peers_direct`: as combine_send's.
void dispatch_send(const Layout& layout, const Half& half, const void* x, const int64_t* topk_idx, int num_tokens, int num_topk,
                   bool use_fp8, bool round_scale, bool all_peers_direct, int* send_slot, const DirectReceive& direct,
                   cudaStream_t stream);

void dispatch_recv(const Layout& layout, const Half& half, bool use_fp8, bool use_ue8m0, const ReceiveOutputs& outputs, cudaStream_t stream);

// The whole dispatch in one kernel, for a caller that receives at once (no hook): the send, then, in the same blocks,
// the receive. Only with more than one rank and the pending kernels on (EP_DISPATCHER_PENDING_KERNELS=1); returns false
// and launches nothing otherwise (then dispatch_send, and dispatch_recv).
bool dispatch_in_one_kernel(const Layout& layout, const Half& half, const void* x, const int64_t* topk_idx, int num_tokens, int num_topk,
                            bool use_fp8, bool round_scale, bool use_ue8m0, bool all_peers_direct, int* send_slot,
                            const ReceiveOutputs& outputs, cudaStream_t stream);

// `all_peers_direct`: every peer is directly addressable (none is reached by NVSHMEM puts).
void combine_send(const Layout& layout, const Half& half, const void* x, bool x_is_staged, bool all_peers_direct,
                  const int64_t* layout_range, cudaStream_t stream);

// The combine's receive arguments: out [num_tokens, hidden] bf16 = the weighted sum of each token's expert outputs.
struct ReduceArgs {
    const int64_t* topk_idx;
    const float* topk_weights;
    const int* send_slot;
    int num_tokens;
    int num_topk;
    void* out;
    int64_t* wait_stats;
};

// `x_is_staged`: as combine_send's (the zero-copy buffer), which one_rank_fused reads in place.
void combine_recv(const Layout& layout, const Half& half, const ReduceArgs& args, bool x_is_staged, int num_sms, cudaStream_t stream);

// The whole combine in one kernel, as dispatch_in_one_kernel (same conditions; false: combine_send, then combine_recv).
bool combine_in_one_kernel(const Layout& layout, const Half& half, const void* x, bool x_is_staged, bool all_peers_direct,
                           const int64_t* layout_range, const ReduceArgs& args, int num_sms, cudaStream_t stream);

// The widest grid a dispatch or combine of `num_tokens` tokens launches, in 512-thread block equivalents (what the
// benchmark reports as the call's share of the SMs).
int widest_grid_blocks(const Layout& layout, int max_blocks, int num_tokens);

}  // namespace ep::low_latency
