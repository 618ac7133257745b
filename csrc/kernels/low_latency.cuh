// Low-latency (decode) kernels over NVSHMEM symmetric memory.
//
// Buffer: two halves (calls alternate between them, so one call's receive can overlap the next call's send).
// Each half, inside the symmetric allocation, at the same offset on every rank:
//   send   : dispatch: one staged message per token (FP8 cast or BF16 copy, 16-byte header first);
//            combine : the [E_local, R * T, H] bf16 expert outputs (the zero-copy buffer, staged for puts).
//   recv   : dispatch: [E_local][R][T] messages, one region per (local expert, source rank), so senders never
//            contend for slots; combine: [E][T] bf16 rows, expert-major, at the slot the source chose in dispatch.
//   signal : dispatch counts [E_local][R], combine flags [E], receive acks [R] (all uint64).
// Signals carry the half's epoch (calls of that half so far + 1) in their upper 32 bits, so they never need
// resetting; a dispatch count is in the lower 32 bits. After a rank has read a half it acks every sender, and a
// sender waits for that ack before writing into the half again: a rank that runs a call ahead cannot overwrite
// data a slower rank has not read yet.
//
// Ordering is deterministic: a sender gives its tokens to an expert in token order (slot = rank among this
// rank's entries for that expert), the receiver packs source ranks in ascending order; combine sums top-k
// entries in k order in fp32 (mul then add, no FMA), matching the reference backend bit for bit.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace ep::low_latency {

constexpr int kHeaderBytes = 16;  // a message's header: source token index (int32) + padding to 16 bytes
constexpr int kFp8GroupSize = 128;
constexpr int kMaxRanks = 1024;  // shared-memory prefix arrays in the receive kernel

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

// Same arithmetic as ep_dispatcher.config.get_low_latency_rdma_size_hint (2 * half_bytes == the hint).
Layout make_layout(int num_ranks, int num_experts, int max_tokens, int hidden);

// Per-Buffer device state outside the symmetric heap: epochs and the receive kernels' block-arrival counters.
struct State {
    unsigned long long epoch[2];
    unsigned int arrived[2];
};

// Pointers the kernels need for one half of the buffer.
struct Half {
    uint8_t* local;            // this rank's half (symmetric address: also valid as a put target for any PE)
    const int64_t* peer_base;  // device [R]: start of the peer's whole buffer, directly addressable (NVLink/P2P), or 0 -> NVSHMEM put
    int64_t half_offset;       // bytes from the buffer's start to this half (peer address = peer_base + half_offset + offset)
    int half;                  // 0 or 1
    int rank;
    // Upper bound on every kernel's grid. The kernels spin on peers' signals, so when several ranks share one GPU
    // (MPS) all their blocks must be resident at once: the bound is SMs / ranks on the GPU (one 512-thread block
    // per SM always fits). With one rank per GPU it is the SM count.
    int max_blocks;
    State* state;
    int64_t timeout_ns;
};

void dispatch_send(const Layout& layout, const Half& half, const void* x, const int64_t* topk_idx, int num_tokens, int num_topk,
                   bool use_fp8, bool round_scale, int* send_slot, cudaStream_t stream);

void dispatch_recv(const Layout& layout, const Half& half, bool use_fp8, bool use_ue8m0, void* recv_x, void* recv_scales, int* src_info,
                   int64_t* layout_range, int* recv_count, int* cumulative_stats, cudaStream_t stream);

void combine_send(const Layout& layout, const Half& half, const void* x, bool x_is_staged, const int64_t* layout_range,
                  cudaStream_t stream);

void combine_recv(const Layout& layout, const Half& half, const int64_t* topk_idx, const float* topk_weights, const int* send_slot,
                  int num_tokens, int num_topk, void* out, int num_sms, cudaStream_t stream);

}  // namespace ep::low_latency
