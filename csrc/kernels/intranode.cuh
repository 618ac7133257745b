// Intranode high-throughput dispatch/combine over CUDA-IPC buffers (NVLink between GPUs, or one GPU shared
// by several processes under MPS).
//
// Design: "write once to the final place". After `notify` exchanges the per-rank counts, every rank knows the
// full count matrix M[src][dst], so a sender can compute where each of its tokens lands in the receiver's
// output (rows grouped by source rank ascending, source order kept: row = sum_{s<src} M[s][dst] + position of
// the token among src's tokens for dst). Each receiver takes its output tensors from its receive pool
// (runtime/recv_pool.h: regions of its CUDA-IPC buffer that the returned tensors own) and publishes their offsets
// in its signal area at a barrier; senders then write every row straight into the receiver's output tensor. No
// ring buffers, no copy-out, no flow control and no spinning SMs in the data kernels: only the one-block barrier
// kernels wait, so any number of ranks can share one GPU without deadlock, whatever num_sms is.
// Combine mirrors it. When a rank's combine input (the expert outputs, in its receive order) lies in its pool, e.g.
// experts that wrote into recv_x or into a pool tensor, it publishes the input and the sources read (pull) the rows
// straight from it: one pass. Otherwise it writes (pushes) each row to a transient region of the source's pool at the
// row the source sent it from (source order: destination rank ascending, token order inside). Either way the source
// sums a token's rows in destination-rank order in fp32 (bias first): the same order as the reference backend,
// hence bit-exact.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "common.cuh"
#include "constants.h"

namespace ep::intranode {

constexpr int kMaxRanks = 128;     // ranks one IPC domain is sized for (NVL72 fits); the signal area scales with it
constexpr int kMaxExperts = 8192;  // experts whose counts fit in the signal area
// Signal area at the start of every rank's buffer: barrier flags, this rank's per-rank and per-expert counts, and
// the input error its last send-position pass found (read by peers during notify, so every rank raises together).
constexpr size_t kFlagsOffset = 0;
constexpr size_t kCountsOffset = kFlagsOffset + sizeof(int) * kMaxRanks;
constexpr size_t kExpertCountsOffset = kCountsOffset + sizeof(int) * kMaxRanks;
constexpr size_t kInputErrorOffset = kExpertCountsOffset + sizeof(int) * kMaxExperts;
constexpr size_t kSignalBytes = 64 * 1024;  // holds all of the above, and keeps data 64 KiB aligned

// A bad input found on the device (contents the host cannot see without a sync). The first finder wins.
enum InputErrorCode : int { kInputOk = 0, kTopkIdxOutOfRange = 1, kTokensPerRankMismatch = 2, kRowShapeMismatch = 3 };
struct InputError {
    int code;   // InputErrorCode
    int where;  // kTopkIdxOutOfRange: token; kTokensPerRankMismatch: destination rank; kRowShapeMismatch: 0 x, 1 scales, 2 top-k
    int slot;   // kTopkIdxOutOfRange: top-k column; kTokensPerRankMismatch: the count is_token_in_rank gives;
                // kRowShapeMismatch: this rank's row bytes (x, scales) or top-k width
    int rank;   // filled by notify: the rank whose input it is
    long long value;  // the bad expert id, the num_tokens_per_rank entry, or the peer's row bytes / top-k width
};
// Where this call's regions start in a rank's data area, published at the barrier before the data kernels
// (-1: this call does not write that field). The rows entries bound the writes (a num_worst_tokens overflow traps
// on the sender instead of overrunning the receiver's tensor).
enum PublishedField : int {
    kPubRecvX,
    kPubRecvScales,
    kPubRecvTopk,
    kPubRecvWeights,
    kPubRecvSrc,
    kPubRecvRows,
    kPubCombineX,
    kPubCombineWeights,
    kPubCombineRows,
    kPubCombineInputX,        // the combine input itself, when it lies in the pool: sources pull from it
    kPubCombineInputWeights,  // likewise its top-k weights (-1 with a pulled x: no weights)
    // A fresh dispatch's receive block, published by notify with the counts (the device lays the outputs out in it):
    kPubBlockOffset,
    kPubBlockBytes,
    kPubBlockRows,  // num_worst_tokens, or -1: the rows the counts give
    kPubRowShape,   // x row bytes, scale row bytes and top-k width, packed (every rank must send the same rows)
    kPubPoolBytes,  // the rank's receive-pool size: growth is decided on the group's smallest, so all ranks agree
    // An expert-major dispatch (fused permute): its row map [recv rows, top-k] int64, the inverse row -> pair [M] int64,
    // and M, the expert-major rows x and scales have (bounds the senders' writes).
    kPubRecvRowMap,
    kPubRecvRowPair,
    kPubRecvExpertRows,
    kNumPublished
};
struct Published {
    int64_t value[kNumPublished];
};
constexpr size_t kPublishedOffset = (kInputErrorOffset + sizeof(InputError) + 63) / 64 * 64;
// Blocks of this rank's send_positions kernel that have finished (its last block runs notify and resets it).
constexpr size_t kScanArrivalsOffset = kPublishedOffset + sizeof(Published);
static_assert(kScanArrivalsOffset + sizeof(unsigned) <= kSignalBytes, "signal area too small");

// Where a dispatch's outputs lie inside the receive block of `rows` rows: x | scales | top-k ids | top-k weights |
// source indices, each region aligned. Host (carving the tensors) and device (senders addressing a receiver's
// block) use this one function, so they agree by construction. Absent fields take no bytes.
struct ReceiveLayout {
    int64_t x, scales, topk, weights, src, end;  // byte offsets from the block's start; `end` = bytes the block needs
};
__host__ __device__ inline ReceiveLayout receive_layout(int64_t rows, int x_row_bytes, int scale_row_bytes, int num_topk, bool with_src) {
    constexpr int64_t kAlign = kRegionAlignment;
    ReceiveLayout l{};
    l.x = 0;
    l.scales = l.x + align_up(rows * x_row_bytes, kAlign);
    l.topk = l.scales + align_up(rows * scale_row_bytes, kAlign);
    l.weights = l.topk + align_up(rows * num_topk * static_cast<int64_t>(sizeof(int64_t)), kAlign);
    l.src = l.weights + align_up(rows * num_topk * static_cast<int64_t>(sizeof(float)), kAlign);
    l.end = l.src + (with_src ? align_up(rows * static_cast<int64_t>(sizeof(int)), kAlign) : 0);
    return l;
}

// An expert-major dispatch's outputs (fused permute, docs/fused_permute.md) in its receive block of `rows` received
// tokens and `num_rows` expert-major rows: the received-order fields of receive_layout without x and scales (top-k ids,
// weights and source indices stay in received order), then x and scales as `num_rows` expert-major rows, the row map
// [rows, top-k] and the inverse map [num_rows] (both int64). A cached one (`fresh` false) has x and scales only.
struct ExpertMajorReceiveLayout {
    ReceiveLayout order;  // topk, weights, src (its x and scales take no bytes)
    int64_t x, scales, row_map, row_pair, end;
};
__host__ __device__ inline ExpertMajorReceiveLayout expert_major_receive_layout(int64_t rows, int64_t num_rows, int x_row_bytes,
                                                                                int scale_row_bytes, int num_topk, bool fresh) {
    constexpr int64_t kAlign = kRegionAlignment;
    ExpertMajorReceiveLayout l{};
    l.order = receive_layout(fresh ? rows : 0, 0, 0, fresh ? num_topk : 0, fresh);
    l.x = l.order.end;
    l.scales = l.x + align_up(num_rows * x_row_bytes, kAlign);
    l.row_map = l.scales + align_up(num_rows * scale_row_bytes, kAlign);
    l.row_pair = l.row_map + (fresh ? align_up(rows * num_topk * static_cast<int64_t>(sizeof(int64_t)), kAlign) : 0);
    l.end = l.row_pair + (fresh ? align_up(num_rows * static_cast<int64_t>(sizeof(int64_t)), kAlign) : 0);
    return l;
}

// Where a fresh dispatch writes into one receiver: offsets in its data area (-1: field not written) and its rows.
// Notify computes them for every receiver from the published blocks and the count matrix, so the data kernel runs
// right after it, with no host round trip and no second barrier.
struct ReceiverRegions {
    int64_t x, scales, topk, weights, src, rows;
};

// What a fresh dispatch's count exchange reports to the host, in host-mapped pinned memory that the host polls
// (no stream sync, no device-to-host copy). `tag` is written last, after everything else is visible.
struct CountReport {
    int tag;
    InputError error;  // the lowest rank's error, code kInputOk if none
    int fits;          // 1: every receiver's rows fit in the block it published (the data kernel ran), else 0
    long long min_pool_bytes;  // the smallest receive pool of the group
    int count_matrix[kMaxRanks * kMaxRanks];
    int recv_per_expert[kMaxExperts];
    int expert_rows[kMaxRanks];  // expert-major dispatch: each receiver's M (sum of its aligned per-expert counts)
};

// Base address of every rank's buffer, as mapped in this process (index = rank). Passed by value to kernels.
struct Peers {
    char* base[kMaxRanks];
};

// The internode engine's staging area (one dispatch's fields, back to back) and its copy-out.
// Where the fields of one dispatch live inside a rank's data area (offsets from the data area's start).
struct DispatchRegions {
    int64_t x_offset, scales_offset, topk_offset, weights_offset, src_offset;
    int capacity;  // rows that fit
};

DispatchRegions dispatch_regions(size_t data_bytes, int x_row_bytes, int scale_row_bytes, int num_topk);
// Receiver side: copies the received rows out of this rank's data area; rows [num_recv, rows_out) get
// topk_idx = -1, weight 0, src = -1 (recv_x padding is left unspecified). Traps if num_recv > rows_out.
void copy_out(const char* data, const DispatchRegions& regions, const int* count_matrix, int rank, int num_ranks, int rows_out,
              void* recv_x, int x_row_bytes, void* recv_scales, int scale_row_bytes, int64_t* recv_topk_idx,
              float* recv_topk_weights, int num_topk, int* recv_src_idx, int num_sms, cudaStream_t stream);

// Bytes of a rank's data area that `rows` received rows take (each field its own aligned region), and the most
// rows an empty pool of `data_bytes` holds; the same formulas size the receive-pool reservations.
int64_t dispatch_bytes(int64_t rows, int x_row_bytes, int scale_row_bytes, int num_topk, bool with_src);
int64_t combine_bytes(int64_t rows, int x_row_bytes, int num_topk);
int dispatch_capacity(int64_t data_bytes, int x_row_bytes, int scale_row_bytes, int num_topk);
int combine_capacity(int64_t data_bytes, int x_row_bytes, int num_topk);

// The arguments of notify (below), one struct so that send_positions can run notify in its last block.
struct NotifyArgs {
    Peers peers;
    int rank, num_ranks;
    int* epoch;
    const int* num_tokens_per_rank;    // the counts send_positions wrote
    const int* num_tokens_per_expert;  // null: no per-expert counts
    int num_experts, expert_alignment;
    int64_t pool_bytes, block_offset, block_bytes, block_rows;
    int x_row_bytes, scale_row_bytes, num_topk;
    int* count_matrix;
    int* rank_prefix_matrix;
    int* recv_per_expert;
    ReceiverRegions* plan;
    int* go;
    CountReport* report;
    int report_tag;
    int64_t timeout_ns;
    int* expert_table;  // null unless expert-major
};

// Send positions of a fresh dispatch, on the device (no torch scan, no host sync): send_pos[t][d] = tokens before t
// that go to rank d; counts[d] = tokens that go to d. Also checks the contents the host cannot see without a sync:
// topk_idx entries in [-1, num_experts) (topk_idx may be null) and num_tokens_per_rank == counts. The first error
// goes to this rank's signal area, where notify publishes it to every rank. `then_notify` (or null): the last block of
// the kernel to finish runs notify with these arguments (whose num_tokens_per_rank must be `counts`), which saves
// notify's own launch.
void send_positions(const Peers& peers, int rank, int num_ranks, const bool* is_token_in_rank, int num_tokens,
                    const int* num_tokens_per_rank, const int64_t* topk_idx, int num_topk, int num_experts, int* send_pos, int* counts,
                    const NotifyArgs* then_notify, cudaStream_t stream);

// The fresh dispatch's count exchange. Writes this rank's counts, its pool size and its receive block (offset, bytes,
// fixed rows or -1, row shape) into its own signal area, waits for all ranks, reads everyone's counts:
// count_matrix[s * num_ranks + d] = tokens rank s sends to rank d; rank_prefix_matrix[s][d] = sum over s' <= s;
// recv_per_expert[e] = tokens this rank receives for local expert e, rounded up to expert_alignment (skipped when
// num_tokens_per_expert is null). For every receiver it lays out the outputs in that receiver's block (`plan`) and
// sets `go` to 1 when every receiver's rows fit and no rank's input is bad, else 0 (the data kernel then does nothing
// and the host takes the slow path or raises). `report` (host-mapped) gets the count matrix, the per-expert counts,
// the lowest rank's input error and `fits`, then `report_tag`. No closing barrier: peers read the counts, blocks
// and errors of this call before they reach the dispatch's data barrier, and nobody rewrites them before that.
//
// `expert_table` (expert-major dispatch, else null; needs num_tokens_per_expert; expert_table_ints() ints) gets
// [column totals E | slot bases E | this rank's received pairs per local expert L]: slot_base[g] = the expert-major row
// at receiver g / L where this rank's first pair for global expert g goes (aligned base of the expert there + the pairs
// of lower source ranks for it); the report also gets every receiver's M (expert_rows), so all ranks size alike.
void notify(const NotifyArgs& args, cudaStream_t stream);

// Ints of notify's expert_table.
inline int64_t expert_table_ints(int num_experts, int num_local_experts) {
    return 2 * static_cast<int64_t>(num_experts) + num_local_experts;
}

// Expert-major dispatch, sender side, before notify: pairs[t * num_topk + k] = position of the pair (token t, slot k)
// among this rank's pairs for expert topk_idx[t][k] (token order, then slot order), for pairs whose rank gets the token
// (is_token_in_rank); other entries are left as they are. expert_counts[g] = this rank's pairs for expert g (what
// notify publishes, so the slots every sender computes add up exactly).
void expert_positions(const int64_t* topk_idx, const bool* is_token_in_rank, int num_tokens, int num_topk, int num_experts, int num_ranks,
                      int* pairs, int* expert_counts, cudaStream_t stream);

// Expert-major dispatch, sender side, after the receivers published their regions (kPubRecv*, kPubRecvRowMap/RowPair/
// ExpertRows) at a barrier. Fresh (topk_idx non-null): each pair (token, slot) whose expert is on rank d is written to
// row slot_base[expert] + pairs[pair] of d's expert-major x (and scales); top-k ids, weights and the source index go to
// d's received-order row (as `dispatch`), the row map and its inverse too; pairs [2, num_tokens, num_topk] is rewritten
// in place to (expert-major row, destination rank) per pair (-1 if not sent), which the cached one (topk_idx null)
// reads instead. scales may be null.
void dispatch_expert_major(const Peers& peers, int rank, int num_ranks, const void* x, int x_row_bytes, const void* scales,
                           int scale_row_bytes, const int64_t* topk_idx, const float* topk_weights, int num_topk, int num_local_experts,
                           const bool* is_token_in_rank, const int* send_pos, const int* count_matrix, const int* slot_base, int* pairs,
                           int num_tokens, int num_sms, cudaStream_t stream);

// Expert-major dispatch, receiver side: the padding rows of every local expert e (rows [base + count[e], base +
// aligned[e]) with base = sum of aligned[e' < e]) get zero x and scales and, with row_pair, -1. scales and row_pair may
// be null.
void expert_major_padding(const int* aligned_per_expert, const int* pairs_per_expert, int num_local_experts, void* x, int x_row_bytes,
                          void* scales, int scale_row_bytes, int64_t* row_pair, cudaStream_t stream);

// Timed barrier over all ranks (one block). With `publish`, this rank's offsets go to its signal area first. With
// `clear_input_error`, this rank's recorded input error is cleared after it (every peer has read it by then).
void barrier(const Peers& peers, int rank, int num_ranks, int* epoch, int64_t timeout_ns, int stage, const Published* publish,
             cudaStream_t stream, bool clear_input_error = false);

// Sender side: writes every (token, destination) pair straight into the destination's output regions at its final
// row. The regions come from `plan` (notify's, on this device; nothing is written unless *go) or, with a null plan,
// from the offsets each destination published at the barrier before. topk_idx/topk_weights may be null (then
// nothing is written for them); scales may be null. `clear_input_error` (one rank only, whose notify ran before this
// kernel and was the error's only reader): the kernel clears the recorded input error, so no barrier need follow.
void dispatch(const Peers& peers, int rank, int num_ranks, const void* x, int x_row_bytes, const void* scales,
              int scale_row_bytes, const int64_t* topk_idx, const float* topk_weights, int num_topk, int num_local_experts,
              const bool* is_token_in_rank, const int* send_pos, const int* count_matrix, const ReceiverRegions* plan, const int* go,
              int num_tokens, int num_sms, cudaStream_t stream, bool clear_input_error = false);

// Receiver side of a num_worst_tokens dispatch, after the data barrier: rows [num_recv, rows_out) get recv_src_idx = -1,
// topk_idx = -1 and weight 0 (recv_x padding is left unspecified). topk outputs may be null.
void mark_padding(const int* count_matrix, int rank, int num_ranks, int rows_out, int* recv_src_idx, int64_t* recv_topk_idx,
                  float* recv_topk_weights, int num_topk, cudaStream_t stream);

// Expert side of combine: row r (from source s) goes to s's published combine region at the row s sent it from
// (except this rank's own rows, which its reduce reads in place).
void combine_send(const Peers& peers, int rank, int num_ranks, const void* x, int x_row_bytes, const float* topk_weights,
                  int num_topk, const int* count_matrix, int num_sms, cudaStream_t stream);

// Expert side of an expert-major combine (fused un-permute, docs/fused_permute.md): y [num_rows, hidden] (T = type)
// holds expert-major rows; row_map [received rows, map_topk] (the fused dispatch's, -1 = expert elsewhere) names each
// received token's rows. Each received row's value (its rows of y in ascending row order, fp32 sum from 0, one rounding
// to T: expert_major.unpermute_sum) goes to its source's combine region as combine_send writes it, and this rank's own
// rows too (combine_reduce then takes a null local_x). topk_weights [received rows, num_topk] (received order) as
// combine_send. Traps on a row map entry >= num_rows.
void combine_send_expert_major(const Peers& peers, int rank, int num_ranks, const void* y, int64_t num_rows, int hidden, FloatType type,
                               const int64_t* row_map, int map_topk, const float* topk_weights, int num_topk, const int* count_matrix,
                               int num_sms, cudaStream_t stream);

// Source side of combine: out[t] = bias0[t] + bias1[t] + sum over destination ranks d ascending (token t sent to
// d) of the row d sent back, in fp32, rounded once to the output type. out_weights likewise (fp32, no bias).
// rows_x / rows_weights: this rank's combine region (where peers that did not publish their input pushed the rows);
// rows of peers that published their combine input are read (pulled) straight from it, and this rank's own rows from
// its input local_x / local_weights (combine_send skips them), or, with a null local_x, from rows_x / rows_weights
// (combine_send_expert_major pushed them there).
void combine_reduce(const Peers& peers, const char* rows_x, const float* rows_weights, const void* local_x, const float* local_weights,
                    int rank, int num_ranks, const int* count_matrix,
                    const bool* is_token_in_rank, const int* send_pos, int num_tokens, int hidden, FloatType type,
                    const void* bias0, const void* bias1, void* out, float* out_weights, int num_topk, int num_sms,
                    cudaStream_t stream);

}  // namespace ep::intranode
