// Intranode high-throughput dispatch/combine over CUDA-IPC buffers (NVLink between GPUs, or one GPU shared
// by several processes under MPS).
//
// Design: "write once to the final row". After `notify` exchanges the per-rank counts, every rank knows the
// full count matrix M[src][dst], so a sender can compute where each of its tokens lands in the receiver's
// output (rows grouped by source rank ascending, source order kept: row = sum_{s<src} M[s][dst] + position of
// the token among src's tokens for dst). Senders write tokens straight to that row of the receiver's buffer;
// after a barrier the receiver copies the filled rows out into torch tensors (the buffer is reused by the next
// call). No ring buffers, no flow control and no spinning SMs in the data kernels: only the one-block barrier
// kernels wait, so any number of ranks can share one GPU without deadlock, whatever num_sms is.
// Combine mirrors it: each expert-side row is written to the source rank's buffer at the row the source sent it
// from (source order: destination rank ascending, token order inside), and the source sums a token's rows in
// destination-rank order in fp32 (bias first): the same order as the reference backend, hence bit-exact.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace ep::intranode {

constexpr int kMaxRanks = 128;     // ranks one IPC domain is sized for (NVL72 fits); the signal area scales with it
constexpr int kMaxExperts = 8192;  // experts whose counts fit in the signal area
constexpr int kMaxTopk = 16;       // widest top-k (DESIGN: NUM_MAX_TOPK)
// Signal area at the start of every rank's buffer: barrier flags, this rank's per-rank and per-expert counts, and
// the input error its last send-position pass found (read by peers during notify, so every rank raises together).
constexpr size_t kFlagsOffset = 0;
constexpr size_t kCountsOffset = kFlagsOffset + sizeof(int) * kMaxRanks;
constexpr size_t kExpertCountsOffset = kCountsOffset + sizeof(int) * kMaxRanks;
constexpr size_t kInputErrorOffset = kExpertCountsOffset + sizeof(int) * kMaxExperts;
constexpr size_t kSignalBytes = 64 * 1024;  // holds all of the above, and keeps data 64 KiB aligned

// A bad input found on the device (contents the host cannot see without a sync). The first finder wins.
enum InputErrorCode : int { kInputOk = 0, kTopkIdxOutOfRange = 1, kTokensPerRankMismatch = 2 };
struct InputError {
    int code;   // InputErrorCode
    int where;  // kTopkIdxOutOfRange: token; kTokensPerRankMismatch: destination rank
    int slot;   // kTopkIdxOutOfRange: top-k column; kTokensPerRankMismatch: the count is_token_in_rank gives
    int rank;   // filled by notify: the rank whose input it is
    long long value;  // the bad expert id, or the num_tokens_per_rank entry
};
static_assert(kInputErrorOffset + sizeof(InputError) <= kSignalBytes, "signal area too small");

// What a fresh dispatch's count exchange reports to the host, in host-mapped pinned memory that the host polls
// (no stream sync, no device-to-host copy). `tag` is written last, after everything else is visible.
struct CountReport {
    int tag;
    InputError error;  // the lowest rank's error, code kInputOk if none
    int count_matrix[kMaxRanks * kMaxRanks];
    int recv_per_expert[kMaxExperts];
};

// Base address of every rank's buffer, as mapped in this process (index = rank). Passed by value to kernels.
struct Peers {
    char* base[kMaxRanks];
};

// Where the fields of one dispatch live inside a rank's data area (offsets from the data area's start).
struct DispatchRegions {
    int64_t x_offset, scales_offset, topk_offset, weights_offset, src_offset;
    int capacity;  // rows that fit
};

struct CombineRegions {
    int64_t x_offset, weights_offset;
    int capacity;
};

DispatchRegions dispatch_regions(size_t data_bytes, int x_row_bytes, int scale_row_bytes, int num_topk);
CombineRegions combine_regions(size_t data_bytes, int x_row_bytes, int num_topk);

// Send positions of a fresh dispatch, on the device (no torch scan, no host sync): send_pos[t][d] = tokens before t
// that go to rank d; counts[d] = tokens that go to d. Also checks the contents the host cannot see without a sync:
// topk_idx entries in [-1, num_experts) (topk_idx may be null) and num_tokens_per_rank == counts. The first error
// goes to this rank's signal area, where notify publishes it to every rank.
void send_positions(const Peers& peers, int rank, int num_ranks, const bool* is_token_in_rank, int num_tokens,
                    const int* num_tokens_per_rank, const int64_t* topk_idx, int num_topk, int num_experts, int* send_pos, int* counts,
                    cudaStream_t stream);

// Writes this rank's counts into its own signal area, waits for all ranks, reads everyone's counts:
// count_matrix[s * num_ranks + d] = tokens rank s sends to rank d; rank_prefix_matrix[s][d] = sum over s' <= s;
// recv_per_expert[e] = tokens this rank receives for local expert e, rounded up to expert_alignment (skipped when
// num_tokens_per_expert is null). `report` (host-mapped, may be null) gets the count matrix, the per-expert counts
// and the lowest rank's input error, then `report_tag`. Then waits again so nobody overwrites counts (or clears its
// error) while a peer is still reading them.
void notify(const Peers& peers, int rank, int num_ranks, int* epoch, const int* num_tokens_per_rank,
            const int* num_tokens_per_expert, int num_experts, int expert_alignment, int* count_matrix, int* rank_prefix_matrix,
            int* recv_per_expert, CountReport* report, int report_tag, int64_t timeout_ns, cudaStream_t stream);

// Timed barrier over all ranks (one block).
void barrier(const Peers& peers, int rank, int num_ranks, int* epoch, int64_t timeout_ns, int stage, cudaStream_t stream);

// Sender side: writes every (token, destination) pair into the destination's data area at its final row.
// topk_idx/topk_weights may be null (then nothing is written for them); scales may be null.
void dispatch(const Peers& peers, int rank, int num_ranks, const void* x, int x_row_bytes, const void* scales,
              int scale_row_bytes, const int64_t* topk_idx, const float* topk_weights, int num_topk, int num_local_experts,
              const bool* is_token_in_rank, const int* send_pos, const int* count_matrix, int num_tokens,
              const DispatchRegions& regions, int num_sms, cudaStream_t stream);

// Receiver side: copies the received rows out of this rank's data area; rows [num_recv, rows_out) get
// topk_idx = -1, weight 0, src = -1 (recv_x padding is left unspecified). Traps if num_recv > rows_out.
void copy_out(const char* data, const DispatchRegions& regions, const int* count_matrix, int rank, int num_ranks, int rows_out,
              void* recv_x, int x_row_bytes, void* recv_scales, int scale_row_bytes, int64_t* recv_topk_idx,
              float* recv_topk_weights, int num_topk, int* recv_src_idx, int num_sms, cudaStream_t stream);

// Expert side of combine: row r (from source s) goes to s's data area at the row s sent it from.
void combine_send(const Peers& peers, int rank, int num_ranks, const void* x, int x_row_bytes, const float* topk_weights,
                  int num_topk, const int* count_matrix, const CombineRegions& regions, int num_sms, cudaStream_t stream);

enum class FloatType : int { kBFloat16 = 0, kFloat32 = 1 };

// Source side of combine: out[t] = bias0[t] + bias1[t] + sum over destination ranks d ascending (token t sent to
// d) of the row d sent back, in fp32, rounded once to the output type. out_weights likewise (fp32, no bias).
void combine_reduce(const char* data, const CombineRegions& regions, int rank, int num_ranks, const int* count_matrix,
                    const bool* is_token_in_rank, const int* send_pos, int num_tokens, int hidden, FloatType type,
                    const void* bias0, const void* bias1, void* out, float* out_weights, int num_topk, int num_sms,
                    cudaStream_t stream);

}  // namespace ep::intranode
