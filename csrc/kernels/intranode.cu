// Intranode dispatch/combine kernels; the design is described in intranode.cuh.
#include <cuda_bf16.h>

#include <algorithm>
#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

#include "common.cuh"
#include "constants.h"
#include "copy.cuh"
#include "intranode.cuh"
#include "launch.cuh"
#include "sync.cuh"
#include "vec.cuh"

namespace ep::intranode {
namespace {

constexpr int kMaxFinishBlocks = 64;   // the receive bookkeeping is a few bytes per row: a few blocks suffice

__device__ __forceinline__ int* flags_of(char* base) { return reinterpret_cast<int*>(base + kFlagsOffset); }
__device__ __forceinline__ int* counts_of(char* base) { return reinterpret_cast<int*>(base + kCountsOffset); }
__device__ __forceinline__ int* expert_counts_of(char* base) { return reinterpret_cast<int*>(base + kExpertCountsOffset); }
__device__ __forceinline__ char* data_of(char* base) { return base + kSignalBytes; }
__device__ __forceinline__ InputError* input_error_of(char* base) { return reinterpret_cast<InputError*>(base + kInputErrorOffset); }
__device__ __forceinline__ int64_t* published_of(char* base) { return reinterpret_cast<int64_t*>(base + kPublishedOffset); }

// A peer's published value (written by its barrier kernel before the barrier this kernel's stream passed).
__device__ __forceinline__ int64_t load_published(char* base, int field) {
    return static_cast<int64_t>(*reinterpret_cast<const volatile long long*>(published_of(base) + field));
}

// Calls use(src, load(src)) for src = 0 .. num_ranks - 1 in order, with kPeerBatch loads in flight at a time: a thread
// that walks every peer's value waits one round trip per batch, not one per peer (under a busy HBM each costs
// microseconds).
constexpr int kPeerBatch = 8;
template <typename T, typename Load, typename Use>
__device__ __forceinline__ void for_each_peer_value(int num_ranks, Load&& load, Use&& use) {
    for (int first = 0; first < num_ranks; first += kPeerBatch) {
        T values[kPeerBatch];
#pragma unroll
        for (int j = 0; j < kPeerBatch; ++j) values[j] = first + j < num_ranks ? load(first + j) : T{};
#pragma unroll
        for (int j = 0; j < kPeerBatch; ++j)
            if (first + j < num_ranks) use(first + j, values[j]);
    }
}

constexpr int kScanThreads = 512;  // a block of the scan kernels (send_positions_kernel, expert_positions_kernel)

// Records the first input error of this call in this rank's signal area (later finders lose the compare-and-swap).
__device__ __forceinline__ void report_input_error(InputError* error, int code, int where, int slot, long long value) {
    if (atomicCAS(&error->code, kInputOk, -1) != kInputOk) return;  // -1: claimed, details being written
    error->where = where;
    error->slot = slot;
    error->value = value;
    __threadfence();
    atomicExch(&error->code, code);
}

__global__ void barrier_kernel(Peers peers, int rank, int num_ranks, int* epoch, int64_t timeout_ns, int stage, Published publish,
                               bool has_publish, bool clear_input_error) {
    wait_for_previous_kernel();
    let_next_kernel_start();
    __shared__ int* peer_flags[kMaxRanks];
    for (int r = threadIdx.x; r < num_ranks; r += blockDim.x) peer_flags[r] = flags_of(peers.base[r]);
    // The barrier's fence and release order these stores before this rank's arrival.
    if (has_publish && threadIdx.x < kNumPublished) published_of(peers.base[rank])[threadIdx.x] = publish.value[threadIdx.x];
    __syncthreads();
    sync::block_barrier(peer_flags, flags_of(peers.base[rank]), epoch, rank, num_ranks, timeout_ns, stage);
    if (clear_input_error && threadIdx.x == 0) *input_error_of(peers.base[rank]) = InputError{};
}

// send_positions_kernel's scan: one tile of kScanItems consecutive tokens per thread is a block's whole chunk of a
// destination's column, so that a block loads everything it scans at once (under a busy HBM each dependent round trip
// costs microseconds; the kernel's time is its chain of round trips). A multiple of 16 tokens, so a chunk's start is a
// whole number of 16-byte vectors of is_token_in_rank.
constexpr int kScanItems = 8;
constexpr int kScanChunk = kScanThreads * kScanItems;
// Vectors of is_token_in_rank a thread loads together when it counts the hits before its block's chunk.
constexpr int kCountBatch = 8;
// topk_idx entries a range-check thread loads together (four 16-byte vectors): few enough blocks that the whole grid
// fits on the GPU at once at 65536 tokens x top-8.
constexpr int kCheckEntries = 8;

// This thread's share of the hits in column `dst` of is_token_in_rank [.., num_ranks] over tokens [0, num_tokens):
// 16-byte loads when the matrix is 16-byte aligned (num_tokens is a multiple of 16, see kScanChunk), kCountBatch of
// them in flight, else bytes. A vector's first byte lies in column (16 v) % num_ranks, advanced without a division.
__device__ __forceinline__ int column_hits_below(const bool* is_token_in_rank, int num_ranks, int dst, int num_tokens) {
    const auto* bytes = reinterpret_cast<const uint8_t*>(is_token_in_rank);
    const int64_t num_bytes = static_cast<int64_t>(num_tokens) * num_ranks;
    int hits = 0;
    if (reinterpret_cast<uintptr_t>(bytes) % 16 == 0) {
        const auto* vectors = reinterpret_cast<const int4*>(bytes);
        const int64_t num_vectors = num_bytes / 16;
        const int stride_column = static_cast<int>((int64_t{blockDim.x} * 16) % num_ranks);
        int column = static_cast<int>((int64_t{threadIdx.x} * 16) % num_ranks);
        for (int64_t first = threadIdx.x; first < num_vectors; first += int64_t{kCountBatch} * blockDim.x) {
            int4 words[kCountBatch];
#pragma unroll
            for (int u = 0; u < kCountBatch; ++u) {
                const int64_t v = first + int64_t{u} * blockDim.x;
                words[u] = v < num_vectors ? __ldg(vectors + v) : int4{};
            }
#pragma unroll
            for (int u = 0; u < kCountBatch; ++u) {
                const auto* b = reinterpret_cast<const uint8_t*>(&words[u]);
                int c = column;
#pragma unroll
                for (int j = 0; j < 16; ++j) {
                    hits += c == dst && b[j] != 0 ? 1 : 0;
                    c = c + 1 == num_ranks ? 0 : c + 1;
                }
                column += stride_column;
                column = column >= num_ranks ? column - num_ranks : column;
            }
        }
    } else {
        for (int t = threadIdx.x; t < num_tokens; t += blockDim.x) hits += bytes[static_cast<int64_t>(t) * num_ranks + dst] != 0 ? 1 : 0;
    }
    return hits;
}

__device__ void notify_block(const NotifyArgs& a);

// Blocks [0, num_ranks * num_chunks) each scan one kScanChunk chunk of one destination's column of is_token_in_rank,
// starting from the hits of that column's earlier chunks (counted again by the block: no block waits for another). The
// last chunk's block writes the destination's count. The blocks after them check topk_idx's range, kCheckEntries
// entries a thread, grid-stride.
__global__ void __launch_bounds__(kScanThreads)
    send_positions_kernel(Peers peers, int rank, int num_ranks, int num_chunks, const bool* is_token_in_rank, int num_tokens,
                          const int* num_tokens_per_rank, const int64_t* topk_idx, int num_topk, int num_experts, int* send_pos,
                          int* counts, NotifyArgs then_notify, bool notify_after) {
    wait_for_previous_kernel();
    let_next_kernel_start();
    using BlockScan = cub::BlockScan<int, kScanThreads>;
    using BlockReduce = cub::BlockReduce<int, kScanThreads>;
    __shared__ union {
        typename BlockScan::TempStorage scan;
        typename BlockReduce::TempStorage reduce;
    } storage;
    __shared__ int hits_before;
    InputError* error = input_error_of(peers.base[rank]);
    const int scan_blocks = num_ranks * num_chunks;
    if (static_cast<int>(blockIdx.x) < scan_blocks) {  // uniform over the block: the scan's barriers are never split
        const int dst = static_cast<int>(blockIdx.x) % num_ranks, chunk = static_cast<int>(blockIdx.x) / num_ranks;
        const int chunk_begin = chunk * kScanChunk, chunk_end = min(num_tokens, chunk_begin + kScanChunk);
        const int first = chunk_begin + static_cast<int>(threadIdx.x) * kScanItems;
        // The chunk's bytes are loaded before the earlier chunks are counted: both loads are in flight together.
        bool hit[kScanItems];
#pragma unroll
        for (int i = 0; i < kScanItems; ++i)
            hit[i] = first + i < chunk_end && __ldg(reinterpret_cast<const uint8_t*>(is_token_in_rank) +
                                                    static_cast<int64_t>(first + i) * num_ranks + dst) != 0;
        const int expected = chunk == num_chunks - 1 && threadIdx.x == 0 ? __ldg(num_tokens_per_rank + dst) : 0;
        int below = 0;  // thread 0's sum is the block's
        if (chunk > 0) below = BlockReduce(storage.reduce).Sum(column_hits_below(is_token_in_rank, num_ranks, dst, chunk_begin));
        if (threadIdx.x == 0) hits_before = below;
        __syncthreads();  // hits_before is written, and storage is free for the scan
        int hits = 0;
#pragma unroll
        for (int i = 0; i < kScanItems; ++i) hits += hit[i] ? 1 : 0;
        int position, chunk_total;
        BlockScan(storage.scan).ExclusiveSum(hits, position, chunk_total);
        position += hits_before;
#pragma unroll
        for (int i = 0; i < kScanItems; ++i) {
            if (first + i < chunk_end) send_pos[static_cast<int64_t>(first + i) * num_ranks + dst] = position;
            position += hit[i] ? 1 : 0;
        }
        if (threadIdx.x == 0 && chunk == num_chunks - 1) {
            const int total = hits_before + chunk_total;
            counts[dst] = total;
            if (expected != total) report_input_error(error, kTokensPerRankMismatch, dst, total, expected);
        }
    } else if (topk_idx != nullptr) {
        // topk_idx is 8-byte aligned; 16-byte vectors start at entry `skew` (0 or 1), threads kCheckEntries apart from
        // there, and the leading entry before it (if any) goes to the first check thread.
        const int64_t entries = static_cast<int64_t>(num_tokens) * num_topk;
        const int64_t skew = (reinterpret_cast<uintptr_t>(topk_idx) % 16) / sizeof(int64_t);
        const auto check = [&](int64_t i, int64_t expert) {
            if (expert < -1 || expert >= num_experts)
                report_input_error(error, kTopkIdxOutOfRange, static_cast<int>(i / num_topk), static_cast<int>(i % num_topk), expert);
        };
        const int64_t thread = static_cast<int64_t>(blockIdx.x - scan_blocks) * kScanThreads + threadIdx.x;
        const int64_t threads = static_cast<int64_t>(gridDim.x - scan_blocks) * kScanThreads;
        if (thread == 0 && skew != 0 && entries > 0) check(0, topk_idx[0]);
        for (int64_t i = skew + thread * kCheckEntries; i < entries; i += threads * kCheckEntries) {
            int64_t expert[kCheckEntries];
            if (i + kCheckEntries <= entries) {
                const auto* v = reinterpret_cast<const longlong2*>(topk_idx + i);
                longlong2 pairs[kCheckEntries / 2];
#pragma unroll
                for (int j = 0; j < kCheckEntries / 2; ++j) pairs[j] = __ldg(v + j);
#pragma unroll
                for (int j = 0; j < kCheckEntries / 2; ++j) expert[2 * j] = pairs[j].x, expert[2 * j + 1] = pairs[j].y;
            } else {
#pragma unroll
                for (int j = 0; j < kCheckEntries; ++j) expert[j] = i + j < entries ? topk_idx[i + j] : -1;
            }
#pragma unroll
            for (int j = 0; j < kCheckEntries; ++j) check(i + j, expert[j]);
        }
    }
    if (!notify_after) return;
    // The last block to finish runs notify, with every block's counts and input error visible to it (GPU scope: notify
    // reads them on this GPU, and its own barrier orders what peers see).
    if (sync::arrive_last<false>(reinterpret_cast<unsigned*>(peers.base[rank] + kScanArrivalsOffset))) notify_block(then_notify);
}

// Packs a row shape for the signal area (row bytes < 2^24, top-k < 2^16: far beyond any real shape).
__host__ __device__ constexpr int64_t pack_row_shape(int x_row_bytes, int scale_row_bytes, int num_topk) {
    return (static_cast<int64_t>(x_row_bytes) << 40) | (static_cast<int64_t>(scale_row_bytes) << 16) | num_topk;
}

// notify (intranode.cuh), run by one block: the notify kernel's, or send_positions' last.
__device__ void notify_block(const NotifyArgs& a) {
    const Peers& peers = a.peers;
    const int rank = a.rank, num_ranks = a.num_ranks, num_experts = a.num_experts, expert_alignment = a.expert_alignment;
    const int x_row_bytes = a.x_row_bytes, scale_row_bytes = a.scale_row_bytes, num_topk = a.num_topk;
    const int* num_tokens_per_rank = a.num_tokens_per_rank;
    const int* num_tokens_per_expert = a.num_tokens_per_expert;
    int *count_matrix = a.count_matrix, *rank_prefix_matrix = a.rank_prefix_matrix, *recv_per_expert = a.recv_per_expert;
    int *go = a.go, *expert_table = a.expert_table;
    ReceiverRegions* plan = a.plan;
    CountReport* report = a.report;
    const int64_t pool_bytes = a.pool_bytes, block_offset = a.block_offset, block_bytes = a.block_bytes, block_rows = a.block_rows;
    __shared__ int* peer_flags[kMaxRanks];
    __shared__ int all_fit;
    char* mine = peers.base[rank];
    for (int r = threadIdx.x; r < num_ranks; r += blockDim.x) {
        peer_flags[r] = flags_of(peers.base[r]);
        counts_of(mine)[r] = num_tokens_per_rank[r];
    }
    if (num_tokens_per_expert != nullptr) {
        for (int e = threadIdx.x; e < num_experts; e += blockDim.x) expert_counts_of(mine)[e] = num_tokens_per_expert[e];
    }
    const int64_t row_shape = pack_row_shape(x_row_bytes, scale_row_bytes, num_topk);
    if (threadIdx.x == 0) {
        int64_t* published = published_of(mine);
        published[kPubBlockOffset] = block_offset;
        published[kPubBlockBytes] = block_bytes;
        published[kPubBlockRows] = block_rows;
        published[kPubRowShape] = row_shape;
        published[kPubPoolBytes] = pool_bytes;
        all_fit = 1;
    }
    __syncthreads();
    sync::block_barrier(peer_flags, flags_of(mine), a.epoch, rank, num_ranks, a.timeout_ns, sync::kStageNotifyCounts);

    for (int i = threadIdx.x; i < num_ranks * num_ranks; i += blockDim.x) {
        const int src = i / num_ranks, dst = i % num_ranks;
        const int count = sync::load_relaxed_sys(counts_of(peers.base[src]) + dst);
        count_matrix[i] = count;
        if (report != nullptr) report->count_matrix[i] = count;
    }
    // Per receiver: its prefix column, and where this call's outputs go in the block it published.
    for (int dst = threadIdx.x; dst < num_ranks; dst += blockDim.x) {
        char* theirs = peers.base[dst];
        // The receiver's published block, loaded before the column walk so that the loads overlap.
        const int64_t fixed_rows = plan != nullptr ? load_published(theirs, kPubBlockRows) : 0;
        const int64_t base = plan != nullptr ? load_published(theirs, kPubBlockOffset) : 0;
        const int64_t block_room = plan != nullptr ? load_published(theirs, kPubBlockBytes) : 0;
        int prefix = 0;
        for_each_peer_value<int>(
            num_ranks, [&](int src) { return sync::load_relaxed_sys(counts_of(peers.base[src]) + dst); },
            [&](int src, int count) {
                prefix += count;
                rank_prefix_matrix[src * num_ranks + dst] = prefix;
            });
        if (plan == nullptr) continue;
        const int64_t rows = fixed_rows >= 0 ? fixed_rows : prefix;
        const ReceiveLayout layout = receive_layout(rows, x_row_bytes, scale_row_bytes, num_topk, true);
        if (layout.end > block_room) atomicAnd(&all_fit, 0);
        const bool topk = num_topk > 0, scaled = scale_row_bytes > 0;  // -1: a field this call does not write
        plan[dst] = ReceiverRegions{base + layout.x,    scaled ? base + layout.scales : -1, topk ? base + layout.topk : -1,
                                    topk ? base + layout.weights : -1, base + layout.src, rows};
    }
    if (num_tokens_per_expert != nullptr) {
        const int num_local_experts = num_experts / num_ranks;
        for (int e = threadIdx.x; e < num_local_experts; e += blockDim.x) {
            int total = 0;
            const int column = rank * num_local_experts + e;
            for_each_peer_value<int>(
                num_ranks, [&](int src) { return sync::load_relaxed_sys(expert_counts_of(peers.base[src]) + column); },
                [&](int, int count) { total += count; });
            const int aligned = (total + expert_alignment - 1) / expert_alignment * expert_alignment;
            recv_per_expert[e] = aligned;
            if (report != nullptr) report->recv_per_expert[e] = aligned;
        }
    }
    if (expert_table != nullptr && num_tokens_per_expert != nullptr) {
        // Expert-major slots (fused permute): the same published pair counts as recv_per_expert above, so every sender's
        // slots and every receiver's rows agree. Column totals first (one thread per expert, loads in parallel), then one
        // thread per receiver runs the aligned prefix over its experts.
        const int num_local_experts = num_experts / num_ranks;
        int* column_total = expert_table;
        int* slot_base = expert_table + num_experts;
        int* recv_pairs = slot_base + num_experts;
        for (int g = threadIdx.x; g < num_experts; g += blockDim.x) {
            int total = 0, before = 0;
            for_each_peer_value<int>(
                num_ranks, [&](int src) { return sync::load_relaxed_sys(expert_counts_of(peers.base[src]) + g); },
                [&](int src, int count) {
                    total += count;
                    before += src < rank ? count : 0;
                });
            column_total[g] = total;
            slot_base[g] = before;
            if (g / num_local_experts == rank) recv_pairs[g - rank * num_local_experts] = total;
        }
        __syncthreads();  // the block's global writes above are visible to all its threads past this point
        for (int dst = threadIdx.x; dst < num_ranks; dst += blockDim.x) {
            int base = 0;
            for (int e = 0; e < num_local_experts; ++e) {
                const int g = dst * num_local_experts + e;
                slot_base[g] += base;
                base += static_cast<int>(align_up(column_total[g], expert_alignment));
            }
            if (report != nullptr) report->expert_rows[dst] = base;
        }
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        // Every rank reports the same (lowest) rank's error, so all ranks raise together. Each peer's error code, row
        // shape and pool size are loaded together (one round trip per kPeerBatch peers).
        struct PeerState {
            int error_code;
            int64_t row_shape, pool_bytes;
        };
        int first_error = -1, other_shape = -1;  // the lowest rank with an input error, and with rows of another shape
        int64_t other_row_shape = row_shape;
        long long min_pool = pool_bytes;
        for_each_peer_value<PeerState>(
            num_ranks,
            [&](int src) {
                char* theirs = peers.base[src];
                return PeerState{sync::load_relaxed_sys(&input_error_of(theirs)->code), load_published(theirs, kPubRowShape),
                                 load_published(theirs, kPubPoolBytes)};
            },
            [&](int src, const PeerState& peer) {
                if (first_error < 0 && peer.error_code != kInputOk) first_error = src;
                if (other_shape < 0 && peer.row_shape != row_shape) {
                    other_shape = src;
                    other_row_shape = peer.row_shape;
                }
                min_pool = min(min_pool, static_cast<long long>(peer.pool_bytes));
            });
        InputError found{};
        if (first_error >= 0) {
            const InputError* e = input_error_of(peers.base[first_error]);
            found.code = sync::load_relaxed_sys(&e->code);
            found.where = sync::load_relaxed_sys(&e->where);
            found.slot = sync::load_relaxed_sys(&e->slot);
            found.value = static_cast<long long>(*reinterpret_cast<const volatile long long*>(&e->value));
            found.rank = first_error;
        }
        // Ranks sending rows of another shape would write past the blocks laid out for ours: refuse (first such rank).
        if (found.code == kInputOk && other_shape >= 0) {
            const int x_row = static_cast<int>(other_row_shape >> 40), scale_row = static_cast<int>((other_row_shape >> 16) & 0xffffff),
                      topk = static_cast<int>(other_row_shape & 0xffff);
            found.code = kRowShapeMismatch;
            found.rank = other_shape;
            found.where = x_row != x_row_bytes ? 0 : scale_row != scale_row_bytes ? 1 : 2;
            found.slot = found.where == 0 ? x_row_bytes : found.where == 1 ? scale_row_bytes : num_topk;
            found.value = found.where == 0 ? x_row : found.where == 1 ? scale_row : topk;
        }
        if (go != nullptr) *go = all_fit && found.code == kInputOk ? 1 : 0;
        if (report != nullptr) {
            report->error = found;
            report->fits = all_fit;
            report->min_pool_bytes = min_pool;
            __threadfence_system();  // the report's contents before its tag
            *reinterpret_cast<volatile int*>(&report->tag) = a.report_tag;
        }
    }
}

__global__ void notify_kernel(NotifyArgs args) {
    wait_for_previous_kernel();
    let_next_kernel_start();
    notify_block(args);
}

// Row offset of `src`'s block inside `dst`'s receive layout: sum_{s < src} M[s][dst].
__device__ __forceinline__ int recv_base(const int* count_matrix, int num_ranks, int src, int dst) {
    int base = 0;
    for_each_peer_value<int>(src, [&](int s) { return count_matrix[s * num_ranks + dst]; }, [&](int, int count) { base += count; });
    return base;
}

__global__ void __launch_bounds__(kDataThreadsPerBlock)
    dispatch_kernel(Peers peers, int rank, int num_ranks, const char* x, int x_row_bytes, const char* scales, int scale_row_bytes,
                    const int64_t* topk_idx, const float* topk_weights, int num_topk, int num_local_experts, const bool* is_token_in_rank,
                    const int* send_pos, const int* count_matrix, const ReceiverRegions* plan, const int* go, int num_tokens,
                    bool clear_input_error) {
    wait_for_previous_kernel();
    let_next_kernel_start();
    if (clear_input_error && blockIdx.x == 0 && threadIdx.x == 0) *input_error_of(peers.base[rank]) = InputError{};
    if (go != nullptr && *go == 0) return;  // a receiver's block is too small or an input is bad: the host decides
    __shared__ int base_in_dst[kMaxRanks];
    __shared__ char* dst_x[kMaxRanks];  // each destination's output regions (published), null where not written
    __shared__ char* dst_scales[kMaxRanks];
    __shared__ int64_t* dst_topk[kMaxRanks];
    __shared__ float* dst_weights[kMaxRanks];
    __shared__ int* dst_src[kMaxRanks];
    __shared__ int64_t dst_rows[kMaxRanks];
    __shared__ int dst_rank[kDataWarpsPerBlock][kMaxRanks];
    __shared__ int dst_row[kDataWarpsPerBlock][kMaxRanks];
    for (int d = threadIdx.x; d < num_ranks; d += blockDim.x) {
        base_in_dst[d] = recv_base(count_matrix, num_ranks, rank, d);
        char* data = data_of(peers.base[d]);
        // Offsets from notify's plan, or the ones d published at the barrier before this kernel.
        const auto published = [&](int field) { return load_published(peers.base[d], field); };
        const ReceiverRegions r = plan != nullptr ? plan[d]
                                                  : ReceiverRegions{published(kPubRecvX),       published(kPubRecvScales),
                                                                    published(kPubRecvTopk),    published(kPubRecvWeights),
                                                                    published(kPubRecvSrc),     published(kPubRecvRows)};
        const auto region = [&](int64_t offset) -> char* { return offset < 0 ? nullptr : data + offset; };
        dst_x[d] = region(r.x);
        dst_scales[d] = region(r.scales);
        dst_topk[d] = reinterpret_cast<int64_t*>(region(r.topk));
        dst_weights[d] = reinterpret_cast<float*>(region(r.weights));
        dst_src[d] = reinterpret_cast<int*>(region(r.src));
        dst_rows[d] = r.rows;
    }
    __syncthreads();

    const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
    const int num_warps = gridDim.x * kDataWarpsPerBlock;
    // A scale row of at most one 16-byte vector per lane (FP8: hidden / 32 bytes) travels in registers.
    const bool scales_in_lanes = scales != nullptr && scale_row_bytes % 16 == 0 && scale_row_bytes <= kWarpSize * 16 &&
                                 reinterpret_cast<uintptr_t>(scales) % 16 == 0;
    const bool has_scale_vector = scales_in_lanes && lane * 16 < scale_row_bytes;
    for (int t = blockIdx.x * kDataWarpsPerBlock + warp; t < num_tokens; t += num_warps) {
        // The token's small fields are loaded first, so that their latency overlaps the payload's instead of adding
        // a round trip per token after it.
        int64_t expert = -1;
        float weight = 0.0f;
        if (topk_idx != nullptr && lane < num_topk) {
            expert = topk_idx[static_cast<int64_t>(t) * num_topk + lane];
            weight = topk_weights[static_cast<int64_t>(t) * num_topk + lane];
        }
        int4 scale_vector{};
        if (has_scale_vector)
            scale_vector = __ldg(reinterpret_cast<const int4*>(scales + static_cast<int64_t>(t) * scale_row_bytes) + lane);
        // The destinations of token t, in rank order.
        const bool* in_rank = is_token_in_rank + static_cast<int64_t>(t) * num_ranks;
        const int count = warp_compact(num_ranks, lane, [&](int d) { return in_rank[d]; }, [&](int d, int slot) {
            const int row = base_in_dst[d] + send_pos[static_cast<int64_t>(t) * num_ranks + d];
            if (row >= dst_rows[d]) {
                printf("ep_dispatcher: dispatch on rank %d: row %d for rank %d exceeds the %lld rows it allocated; "
                       "raise num_worst_tokens to the worst case\n", rank, row, d, static_cast<long long>(dst_rows[d]));
                asm volatile("trap;");
            }
            dst_rank[warp][slot] = d;
            dst_row[warp][slot] = row;
        });
        __syncwarp();

        // Payload: read each 16-byte vector once, store it to every destination.
        warp_copy_to_each(
            x + static_cast<int64_t>(t) * x_row_bytes, x_row_bytes, count,
            [&](int j) { return dst_x[dst_rank[warp][j]] + static_cast<int64_t>(dst_row[warp][j]) * x_row_bytes; }, lane);
        for (int j = 0; j < count; ++j) {
            const int d = dst_rank[warp][j];
            const int64_t row = dst_row[warp][j];
            if (has_scale_vector)
                reinterpret_cast<int4*>(dst_scales[d] + row * scale_row_bytes)[lane] = scale_vector;
            else if (scales != nullptr && !scales_in_lanes)
                warp_copy<CopySource::kReadOnly>(dst_scales[d] + row * scale_row_bytes, scales + static_cast<int64_t>(t) * scale_row_bytes,
                                                 scale_row_bytes, lane);
            if (topk_idx != nullptr && lane < num_topk) {
                // Ids become the destination's local ids; experts elsewhere become -1 with weight 0.
                const bool local = expert >= 0 && expert / num_local_experts == d;
                dst_topk[d][row * num_topk + lane] = local ? expert - static_cast<int64_t>(d) * num_local_experts : -1;
                dst_weights[d][row * num_topk + lane] = local ? weight : 0.0f;
            }
            if (lane == 0 && dst_src[d] != nullptr) dst_src[d][row] = t;
        }
        __syncwarp();
    }
}

// The internode engine's receive side (its rows land in a staging area of its NVSHMEM buffer first).
__global__ void __launch_bounds__(kDataThreadsPerBlock)
    copy_out_kernel(const char* data, DispatchRegions regions, const int* count_matrix, int rank, int num_ranks, int rows_out, char* recv_x,
                    int x_row_bytes, char* recv_scales, int scale_row_bytes, int64_t* recv_topk_idx, float* recv_topk_weights, int num_topk,
                    int* recv_src_idx) {
    __shared__ int num_recv;
    if (threadIdx.x == 0) {
        num_recv = recv_base(count_matrix, num_ranks, num_ranks, rank);
        if (num_recv > rows_out) {
            printf("ep_dispatcher: rank %d received %d tokens, more than num_worst_tokens=%d; raise it to the worst case\n", rank,
                   num_recv, rows_out);
            asm volatile("trap;");
        }
    }
    __syncthreads();
    const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
    for (int64_t row = blockIdx.x * kDataWarpsPerBlock + warp; row < rows_out; row += gridDim.x * kDataWarpsPerBlock) {
        if (row < num_recv) {
            warp_copy<CopySource::kReadOnly>(recv_x + row * x_row_bytes, data + regions.x_offset + row * x_row_bytes, x_row_bytes, lane);
            if (recv_scales != nullptr)
                warp_copy<CopySource::kReadOnly>(recv_scales + row * scale_row_bytes, data + regions.scales_offset + row * scale_row_bytes,
                                                 scale_row_bytes, lane);
            if (recv_topk_idx != nullptr && lane < num_topk) {
                recv_topk_idx[row * num_topk + lane] = reinterpret_cast<const int64_t*>(data + regions.topk_offset)[row * num_topk + lane];
                recv_topk_weights[row * num_topk + lane] =
                    reinterpret_cast<const float*>(data + regions.weights_offset)[row * num_topk + lane];
            }
            if (lane == 0) recv_src_idx[row] = reinterpret_cast<const int*>(data + regions.src_offset)[row];
        } else {
            if (recv_topk_idx != nullptr && lane < num_topk) {
                recv_topk_idx[row * num_topk + lane] = -1;
                recv_topk_weights[row * num_topk + lane] = 0.0f;
            }
            if (lane == 0) recv_src_idx[row] = -1;
        }
    }
}

__global__ void mark_padding_kernel(const int* count_matrix, int rank, int num_ranks, int rows_out, int* recv_src_idx,
                                    int64_t* recv_topk_idx, float* recv_topk_weights, int num_topk) {
    wait_for_previous_kernel();
    let_next_kernel_start();
    __shared__ int num_recv;
    if (threadIdx.x == 0) num_recv = recv_base(count_matrix, num_ranks, num_ranks, rank);
    __syncthreads();
    for (int64_t row = num_recv + static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; row < rows_out;
         row += static_cast<int64_t>(gridDim.x) * blockDim.x) {
        recv_src_idx[row] = -1;
        if (recv_topk_idx != nullptr) {
            for (int k = 0; k < num_topk; ++k) {
                recv_topk_idx[row * num_topk + k] = -1;
                recv_topk_weights[row * num_topk + k] = 0.0f;
            }
        }
    }
}

// Where the expert side of a combine sends each of its received rows: the sources' published combine regions, at the
// row each source sent the token from. Shared by both send kernels (received-order and expert-major input).
struct CombineTargets {
    int row_begin[kMaxRanks + 1];  // rows of source s in this rank's received rows: [row_begin[s], row_begin[s+1])
    int base_at_src[kMaxRanks];    // where this rank's block starts in source s's send order
    char* src_x[kMaxRanks];        // source s's combine region (published)
    float* src_weights[kMaxRanks];
    int64_t src_rows[kMaxRanks];
};

// Fills `t` (in shared memory) from the count matrix and the offsets the sources published; ends with __syncthreads.
__device__ __forceinline__ void load_combine_targets(CombineTargets& t, const Peers& peers, int rank, int num_ranks,
                                                     const int* count_matrix) {
    if (threadIdx.x == 0) {
        int total = 0;
        for (int s = 0; s < num_ranks; ++s) {
            t.row_begin[s] = total;
            total += count_matrix[s * num_ranks + rank];
        }
        t.row_begin[num_ranks] = total;
    }
    for (int s = threadIdx.x; s < num_ranks; s += blockDim.x) {
        int base = 0;
        for (int d = 0; d < rank; ++d) base += count_matrix[s * num_ranks + d];
        t.base_at_src[s] = base;
        char* data = data_of(peers.base[s]);
        t.src_x[s] = data + load_published(peers.base[s], kPubCombineX);
        const int64_t weights = load_published(peers.base[s], kPubCombineWeights);
        t.src_weights[s] = weights < 0 ? nullptr : reinterpret_cast<float*>(data + weights);
        t.src_rows[s] = load_published(peers.base[s], kPubCombineRows);
    }
    __syncthreads();
}

// The source of received row `row` (into `src`) and the row it goes back to there. A row beyond what the source
// allocated traps (lane 0 reports it); the caller skips the row on -1. The same value on every lane of the warp.
__device__ __forceinline__ int64_t back_row_of(const CombineTargets& t, int rank, int row, int& src, int lane) {
    src = 0;
    while (row >= t.row_begin[src + 1]) ++src;
    const int64_t back_row = t.base_at_src[src] + (row - t.row_begin[src]);
    if (back_row < t.src_rows[src]) return back_row;
    if (lane == 0) {
        printf("ep_dispatcher: combine on rank %d: row %lld for rank %d exceeds the %lld rows it allocated\n", rank,
               static_cast<long long>(back_row), src, static_cast<long long>(t.src_rows[src]));
        asm volatile("trap;");
    }
    return -1;
}

__global__ void __launch_bounds__(kDataThreadsPerBlock)
    combine_send_kernel(Peers peers, int rank, int num_ranks, const char* x, int x_row_bytes, const float* topk_weights, int num_topk,
                        const int* count_matrix) {
    wait_for_previous_kernel();
    let_next_kernel_start();
    __shared__ CombineTargets targets;
    load_combine_targets(targets, peers, rank, num_ranks, count_matrix);
    const int num_recv = targets.row_begin[num_ranks];
    const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
    for (int row = blockIdx.x * kDataWarpsPerBlock + warp; row < num_recv; row += gridDim.x * kDataWarpsPerBlock) {
        int src;
        const int64_t back_row = back_row_of(targets, rank, row, src, lane);
        if (src == rank || back_row < 0) continue;  // this rank's own rows: its reduce reads them from x where they are
        warp_copy<CopySource::kReadOnly>(targets.src_x[src] + back_row * x_row_bytes, x + static_cast<int64_t>(row) * x_row_bytes,
                                         x_row_bytes, lane);
        if (topk_weights != nullptr && targets.src_weights[src] != nullptr && lane < num_topk)
            targets.src_weights[src][back_row * num_topk + lane] = topk_weights[static_cast<int64_t>(row) * num_topk + lane];
    }
}

// Expert side of an expert-major combine (fused un-permute): per received row (received order), the token's
// expert-major rows of y (row_map, ascending = local-expert order) summed in fp32 and rounded once to T, written
// straight into the source's combine region (the source's reduce then runs unchanged). This rank's own rows too: its
// input holds no received-order rows to read in place.
template <typename T>
__global__ void __launch_bounds__(kDataThreadsPerBlock)
    combine_send_expert_major_kernel(Peers peers, int rank, int num_ranks, const T* y, int64_t num_rows, int hidden,
                                     const int64_t* row_map, int map_topk, const float* topk_weights, int num_topk,
                                     const int* count_matrix) {
    __shared__ CombineTargets targets;
    __shared__ const int4* token_rows[kDataWarpsPerBlock][kMaxTopk];  // the token's rows of y, ascending
    load_combine_targets(targets, peers, rank, num_ranks, count_matrix);
    const int num_recv = targets.row_begin[num_ranks];
    const int vectors = hidden / Vec<T>::kElems;
    const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
    for (int row = blockIdx.x * kDataWarpsPerBlock + warp; row < num_recv; row += gridDim.x * kDataWarpsPerBlock) {
        int src;
        const int64_t back_row = back_row_of(targets, rank, row, src, lane);
        if (back_row < 0) continue;
        // Lane k holds slot k's row (-1: expert elsewhere); its rank among the token's rows (they are distinct) is its
        // place in ascending order, the order unpermute_sum adds them in.
        const long long mine = lane < map_topk ? row_map[static_cast<int64_t>(row) * map_topk + lane] : -1;
        if (mine >= num_rows) {
            printf("ep_dispatcher: expert-major combine on rank %d: row map entry %lld exceeds the %lld rows of x\n", rank, mine,
                   static_cast<long long>(num_rows));
            asm volatile("trap;");
        }
        int order = 0;
        for (int k = 0; k < map_topk; ++k) {
            const long long other = __shfl_sync(kFullWarpMask, mine, k);
            order += other >= 0 && other < mine ? 1 : 0;
        }
        const int count = __popc(__ballot_sync(kFullWarpMask, mine >= 0));
        if (mine >= 0) token_rows[warp][order] = reinterpret_cast<const int4*>(y + mine * hidden);
        __syncwarp();
        sum_token_rows<T>(nullptr, nullptr, count, [&](int j) { return token_rows[warp][j]; },
                          reinterpret_cast<T*>(targets.src_x[src] + back_row * hidden * static_cast<int64_t>(sizeof(T))), vectors, lane);
        if (topk_weights != nullptr && targets.src_weights[src] != nullptr && lane < num_topk)
            targets.src_weights[src][back_row * num_topk + lane] = topk_weights[static_cast<int64_t>(row) * num_topk + lane];
        __syncwarp();
    }
}

template <typename T>
__global__ void __launch_bounds__(kDataThreadsPerBlock)
    combine_reduce_kernel(Peers peers, const char* x_region, const float* w_region, const char* local_x, const float* local_weights,
                          int rank, int num_ranks, const int* count_matrix, const bool* is_token_in_rank, const int* send_pos,
                          int num_tokens, int hidden, const T* bias0, const T* bias1, T* out, float* out_weights, int num_topk) {
    wait_for_previous_kernel();
    let_next_kernel_start();
    using V = Vec<T>;
    // Where destination d's rows for this rank's tokens start: in d's own combine input when d published it (pull:
    // at the rows d received from this rank), else in this rank's combine region, where d pushed them. This rank's
    // own rows are read from its input (local_x), where they are; with a null local_x (expert-major input, whose own
    // rows were summed and pushed like a peer's) from the region too.
    __shared__ const char* x_base[kMaxRanks];
    __shared__ const float* w_base[kMaxRanks];
    __shared__ const char* rows[kDataWarpsPerBlock][kMaxRanks];
    __shared__ const float* weight_rows[kDataWarpsPerBlock][kMaxRanks];
    const int64_t row_bytes = static_cast<int64_t>(hidden) * sizeof(T);
    if (threadIdx.x == 0) {
        int send_base = 0;
        for (int d = 0; d < num_ranks; ++d) {
            const int64_t input = load_published(peers.base[d], kPubCombineInputX);
            if (d == rank && local_x != nullptr) {
                const int64_t first = recv_base(count_matrix, num_ranks, rank, d);
                x_base[d] = local_x + first * row_bytes;
                w_base[d] = local_weights == nullptr ? nullptr : local_weights + first * num_topk;
            } else if (input >= 0) {
                const int64_t first = recv_base(count_matrix, num_ranks, rank, d);
                const int64_t weights = load_published(peers.base[d], kPubCombineInputWeights);
                x_base[d] = data_of(peers.base[d]) + input + first * row_bytes;
                w_base[d] = weights < 0 ? nullptr : reinterpret_cast<const float*>(data_of(peers.base[d]) + weights) + first * num_topk;
            } else {
                x_base[d] = x_region + send_base * row_bytes;
                w_base[d] = w_region == nullptr ? nullptr : w_region + static_cast<int64_t>(send_base) * num_topk;
            }
            send_base += count_matrix[rank * num_ranks + d];
        }
    }
    __syncthreads();
    const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
    const int vectors = hidden / V::kElems;
    for (int t = blockIdx.x * kDataWarpsPerBlock + warp; t < num_tokens; t += gridDim.x * kDataWarpsPerBlock) {
        // Token t's rows, by destination rank ascending.
        const bool* in_rank = is_token_in_rank + static_cast<int64_t>(t) * num_ranks;
        const int count = warp_compact(num_ranks, lane, [&](int d) { return in_rank[d]; }, [&](int d, int slot) {
            const int64_t position = send_pos[static_cast<int64_t>(t) * num_ranks + d];
            rows[warp][slot] = x_base[d] + position * row_bytes;
            weight_rows[warp][slot] = w_base[d] == nullptr ? nullptr : w_base[d] + position * num_topk;
        });
        __syncwarp();
        // Bias first, then destination ranks ascending: the reference backend's order.
        const int64_t first = static_cast<int64_t>(t) * hidden;
        sum_token_rows(
            bias0 != nullptr ? bias0 + first : nullptr, bias1 != nullptr ? bias1 + first : nullptr, count,
            [&](int j) { return reinterpret_cast<const int4*>(rows[warp][j]); }, out + first, vectors, lane);
        if (out_weights != nullptr && lane < num_topk)
            out_weights[static_cast<int64_t>(t) * num_topk + lane] =
                sum_token_weights(count, [&](int j) { return weight_rows[warp][j]; }, lane);
        __syncwarp();
    }
}

// ------------------------------------------------------------------ expert-major dispatch (fused permute)
// One block per global expert g: the position of each of this rank's pairs (token, slot) for g among its pairs for g,
// in token order then slot order (the order the receiver's expert-major rows keep), by the same run-per-thread block
// scan as send_positions_kernel. Pairs whose token is not sent to g's rank are not counted (they are not sent).
__global__ void __launch_bounds__(kScanThreads)
    expert_positions_kernel(const int64_t* topk_idx, const bool* is_token_in_rank, int num_tokens, int num_topk, int num_local_experts,
                            int num_ranks, int* pairs, int* expert_counts) {
    using BlockScan = cub::BlockScan<int, kScanThreads>;
    __shared__ typename BlockScan::TempStorage scan_storage;
    const int expert = blockIdx.x;
    const int dst = expert / num_local_experts;
    const int run = ceil_div(num_tokens, kScanThreads);
    const int begin = min(num_tokens, static_cast<int>(threadIdx.x) * run), end = min(num_tokens, begin + run);
    const auto picks = [&](int t, int k) { return topk_idx[static_cast<int64_t>(t) * num_topk + k] == expert; };
    int hits = 0;
    for (int t = begin; t < end; ++t) {
        if (!is_token_in_rank[static_cast<int64_t>(t) * num_ranks + dst]) continue;
        for (int k = 0; k < num_topk; ++k) hits += picks(t, k) ? 1 : 0;
    }
    int position, total;
    BlockScan(scan_storage).ExclusiveSum(hits, position, total);
    for (int t = begin; t < end; ++t) {
        if (!is_token_in_rank[static_cast<int64_t>(t) * num_ranks + dst]) continue;
        for (int k = 0; k < num_topk; ++k)
            if (picks(t, k)) pairs[static_cast<int64_t>(t) * num_topk + k] = position++;
    }
    if (threadIdx.x == 0) expert_counts[expert] = total;
}

// Sender side of an expert-major dispatch (see intranode.cuh): one warp per token; each top-k lane owns its pair.
__global__ void __launch_bounds__(kDataThreadsPerBlock)
    dispatch_expert_major_kernel(Peers peers, int rank, int num_ranks, const char* x, int x_row_bytes, const char* scales,
                                 int scale_row_bytes, const int64_t* topk_idx, const float* topk_weights, int num_topk,
                                 int num_local_experts, const bool* is_token_in_rank, const int* send_pos, const int* count_matrix,
                                 const int* slot_base, int* pairs, int num_tokens) {
    const bool fresh = topk_idx != nullptr;
    __shared__ int base_in_dst[kMaxRanks];  // received-order rows (top-k ids, weights, source index, row map)
    __shared__ char* dst_x[kMaxRanks];      // expert-major rows (x, scales)
    __shared__ char* dst_scales[kMaxRanks];
    __shared__ int64_t* dst_topk[kMaxRanks];
    __shared__ float* dst_weights[kMaxRanks];
    __shared__ int* dst_src[kMaxRanks];
    __shared__ int64_t* dst_row_map[kMaxRanks];
    __shared__ int64_t* dst_row_pair[kMaxRanks];
    __shared__ int64_t dst_rows[kMaxRanks];
    __shared__ int64_t dst_expert_rows[kMaxRanks];
    __shared__ char* pair_x[kDataWarpsPerBlock][kMaxTopk];  // the token's pairs, compacted: where each one's x row goes
    __shared__ char* pair_scales[kDataWarpsPerBlock][kMaxTopk];
    __shared__ int dst_rank[kDataWarpsPerBlock][kMaxRanks];
    __shared__ int dst_row[kDataWarpsPerBlock][kMaxRanks];
    for (int d = threadIdx.x; d < num_ranks; d += blockDim.x) {
        char* data = data_of(peers.base[d]);
        const auto region = [&](int field) -> char* {
            const int64_t offset = load_published(peers.base[d], field);
            return offset < 0 ? nullptr : data + offset;
        };
        dst_x[d] = region(kPubRecvX);
        dst_scales[d] = region(kPubRecvScales);
        dst_expert_rows[d] = load_published(peers.base[d], kPubRecvExpertRows);
        if (fresh) {
            base_in_dst[d] = recv_base(count_matrix, num_ranks, rank, d);
            dst_topk[d] = reinterpret_cast<int64_t*>(region(kPubRecvTopk));
            dst_weights[d] = reinterpret_cast<float*>(region(kPubRecvWeights));
            dst_src[d] = reinterpret_cast<int*>(region(kPubRecvSrc));
            dst_row_map[d] = reinterpret_cast<int64_t*>(region(kPubRecvRowMap));
            dst_row_pair[d] = reinterpret_cast<int64_t*>(region(kPubRecvRowPair));
            dst_rows[d] = load_published(peers.base[d], kPubRecvRows);
        }
    }
    __syncthreads();

    const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
    const int64_t num_pairs = static_cast<int64_t>(num_tokens) * num_topk;
    for (int t = blockIdx.x * kDataWarpsPerBlock + warp; t < num_tokens; t += gridDim.x * kDataWarpsPerBlock) {
        // This lane's pair: its expert-major row and destination rank (-1: not sent). A fresh call derives them from
        // the expert's slot base and the pair's position, and keeps them in `pairs` for the cached calls.
        const int64_t pair = static_cast<int64_t>(t) * num_topk + lane;
        int64_t expert = -1;
        int row = -1, dst = -1;
        if (lane < num_topk) {
            if (fresh) {
                expert = topk_idx[pair];
                // Ids out of range never get here (notify reports them and the host raises before this kernel).
                const int d = expert >= 0 ? static_cast<int>(expert / num_local_experts) : -1;
                if (d >= 0 && d < num_ranks && is_token_in_rank[static_cast<int64_t>(t) * num_ranks + d]) {
                    dst = d;
                    row = slot_base[expert] + pairs[pair];
                }
                pairs[pair] = row;
                pairs[num_pairs + pair] = dst;
            } else {
                row = pairs[pair];
                dst = pairs[num_pairs + pair];
            }
            if (dst >= 0 && row >= dst_expert_rows[dst]) {
                printf("ep_dispatcher: expert-major dispatch on rank %d: row %d for rank %d exceeds its %lld expert-major rows\n", rank,
                       row, dst, static_cast<long long>(dst_expert_rows[dst]));
                asm volatile("trap;");
            }
        }
        const unsigned sent = __ballot_sync(kFullWarpMask, dst >= 0);
        if (dst >= 0) {
            const int slot = __popc(sent & ((1u << lane) - 1));
            pair_x[warp][slot] = dst_x[dst] + static_cast<int64_t>(row) * x_row_bytes;
            pair_scales[warp][slot] = dst_scales[dst] == nullptr ? nullptr : dst_scales[dst] + static_cast<int64_t>(row) * scale_row_bytes;
        }
        const int count = __popc(sent);
        __syncwarp();

        // Payload: read each 16-byte vector once, store it to every row of the token (one per local expert it picked).
        warp_copy_to_each(x + static_cast<int64_t>(t) * x_row_bytes, x_row_bytes, count, [&](int j) { return pair_x[warp][j]; }, lane);
        if (scales != nullptr) {
            for (int j = 0; j < count; ++j)
                warp_copy<CopySource::kReadOnly>(pair_scales[warp][j], scales + static_cast<int64_t>(t) * scale_row_bytes, scale_row_bytes,
                                                 lane);
        }

        if (fresh) {
            // Received order, as `dispatch` writes it: the token's row at each destination rank, in rank order.
            const bool* in_rank = is_token_in_rank + static_cast<int64_t>(t) * num_ranks;
            const int num_dst = warp_compact(num_ranks, lane, [&](int d) { return in_rank[d]; }, [&](int d, int slot) {
                const int recv_row = base_in_dst[d] + send_pos[static_cast<int64_t>(t) * num_ranks + d];
                if (recv_row >= dst_rows[d]) {
                    printf("ep_dispatcher: expert-major dispatch on rank %d: row %d for rank %d exceeds its %lld rows\n", rank, recv_row,
                           d, static_cast<long long>(dst_rows[d]));
                    asm volatile("trap;");
                }
                dst_rank[warp][slot] = d;
                dst_row[warp][slot] = recv_row;
            });
            __syncwarp();
            for (int j = 0; j < num_dst; ++j) {
                const int d = dst_rank[warp][j];
                const int64_t recv_row = dst_row[warp][j];
                if (lane < num_topk) {
                    // Ids become the destination's local ids; experts elsewhere become -1 with weight 0 (as `dispatch`).
                    const bool local = dst == d;
                    const int64_t cell = recv_row * num_topk + lane;
                    dst_topk[d][cell] = local ? expert - static_cast<int64_t>(d) * num_local_experts : -1;
                    dst_weights[d][cell] = local ? topk_weights[pair] : 0.0f;
                    dst_row_map[d][cell] = local ? row : -1;
                    if (local) dst_row_pair[d][row] = cell;
                }
                if (lane == 0) dst_src[d][recv_row] = t;
            }
        }
        __syncwarp();
    }
}

// Receiver side: one block per local expert zeroes its padding rows (they lie back to back, after its pairs' rows).
__global__ void expert_major_padding_kernel(const int* aligned_per_expert, const int* pairs_per_expert, char* x, int x_row_bytes,
                                            char* scales, int scale_row_bytes, int64_t* row_pair) {
    __shared__ int64_t first, padding;
    const int e = blockIdx.x;
    if (threadIdx.x == 0) {
        int64_t base = 0;
        for (int i = 0; i < e; ++i) base += aligned_per_expert[i];
        first = base + pairs_per_expert[e];
        padding = aligned_per_expert[e] - pairs_per_expert[e];
    }
    __syncthreads();
    const auto zero = [&](char* rows, int64_t bytes) {
        if (((reinterpret_cast<uintptr_t>(rows) | static_cast<uintptr_t>(bytes)) & 3) == 0) {
            for (int64_t i = threadIdx.x; i < bytes / 4; i += blockDim.x) reinterpret_cast<int*>(rows)[i] = 0;
        } else {
            for (int64_t i = threadIdx.x; i < bytes; i += blockDim.x) rows[i] = 0;
        }
    };
    zero(x + first * x_row_bytes, padding * x_row_bytes);
    if (scales != nullptr) zero(scales + first * scale_row_bytes, padding * scale_row_bytes);
    if (row_pair != nullptr)
        for (int64_t i = threadIdx.x; i < padding; i += blockDim.x) row_pair[first + i] = -1;
}

}  // namespace

DispatchRegions dispatch_regions(size_t data_bytes, int x_row_bytes, int scale_row_bytes, int num_topk) {
    // The staging area holds the most rows that fit, laid out as a receive block of that many rows.
    DispatchRegions r{};
    r.capacity = dispatch_capacity(static_cast<int64_t>(data_bytes), x_row_bytes, scale_row_bytes, num_topk);
    const ReceiveLayout l = receive_layout(r.capacity, x_row_bytes, scale_row_bytes, num_topk, true);
    r.x_offset = l.x;
    r.scales_offset = l.scales;
    r.topk_offset = l.topk;
    r.weights_offset = l.weights;
    r.src_offset = l.src;
    return r;
}

int64_t dispatch_bytes(int64_t rows, int x_row_bytes, int scale_row_bytes, int num_topk, bool with_src) {
    return receive_layout(rows, x_row_bytes, scale_row_bytes, num_topk, with_src).end;
}

int64_t combine_bytes(int64_t rows, int x_row_bytes, int num_topk) {
    return align_up(rows * x_row_bytes, kRegionAlignment) +
           align_up(rows * num_topk * static_cast<int64_t>(sizeof(float)), kRegionAlignment);
}

int dispatch_capacity(int64_t data_bytes, int x_row_bytes, int scale_row_bytes, int num_topk) {
    const int64_t per_row =
        x_row_bytes + scale_row_bytes + static_cast<int64_t>(num_topk) * (sizeof(int64_t) + sizeof(float)) + sizeof(int);
    const int64_t slack = 5 * kRegionAlignment;  // alignment padding of the five regions
    return static_cast<int>(std::max<int64_t>(0, (data_bytes - slack) / per_row));
}

int combine_capacity(int64_t data_bytes, int x_row_bytes, int num_topk) {
    const int64_t per_row = x_row_bytes + static_cast<int64_t>(num_topk) * sizeof(float);
    return static_cast<int>(std::max<int64_t>(0, (data_bytes - 2 * kRegionAlignment) / per_row));
}

namespace {
// The checks notify's arguments must pass (the row shape is packed into one int64 for the peers).
void check_notify_args(const NotifyArgs& a) {
    EP_HOST_ASSERT(a.num_ranks <= kMaxRanks && a.num_ranks <= kNumThreadsPerBlock, "num_ranks=", a.num_ranks);
    EP_HOST_ASSERT(a.num_experts <= kMaxExperts, "num_experts=", a.num_experts, " exceeds ", kMaxExperts);
    EP_HOST_ASSERT(a.x_row_bytes < (1 << 24) && a.scale_row_bytes < (1 << 24) && a.num_topk < (1 << 16), "row shape ", a.x_row_bytes,
                   "/", a.scale_row_bytes, "/", a.num_topk, " does not pack");
}
}  // namespace

void send_positions(const Peers& peers, int rank, int num_ranks, const bool* is_token_in_rank, int num_tokens,
                    const int* num_tokens_per_rank, const int64_t* topk_idx, int num_topk, int num_experts, int* send_pos, int* counts,
                    const NotifyArgs* then_notify, cudaStream_t stream) {
    EP_HOST_ASSERT(num_ranks <= kMaxRanks, "num_ranks=", num_ranks);
    if (then_notify != nullptr) {
        check_notify_args(*then_notify);
        EP_HOST_ASSERT(then_notify->num_tokens_per_rank == counts, "notify after send_positions reads the counts it wrote");
    }
    // A block per (destination, chunk of tokens), at least one chunk (its block writes the count, even of no tokens);
    // then range-check blocks, enough that each thread loads one batch of topk_idx (a grid-stride loop past the cap).
    constexpr int kMaxCheckBlocks = 1024;
    const int num_chunks = std::max(1, ceil_div(num_tokens, kScanChunk));
    const int64_t entries = topk_idx != nullptr ? static_cast<int64_t>(num_tokens) * num_topk : 0;
    const int64_t check_batches = ceil_div<int64_t>(entries, int64_t{kScanThreads} * kCheckEntries);
    const int check_blocks = static_cast<int>(std::min<int64_t>(kMaxCheckBlocks, check_batches));
    launch_kernel(chained_launch_for(num_ranks), send_positions_kernel, num_ranks * num_chunks + check_blocks, kScanThreads, 0, stream,
                  peers, rank, num_ranks, num_chunks, is_token_in_rank, num_tokens, num_tokens_per_rank, topk_idx, num_topk, num_experts,
                  send_pos, counts, then_notify != nullptr ? *then_notify : NotifyArgs{}, then_notify != nullptr);
}

void notify(const NotifyArgs& args, cudaStream_t stream) {
    check_notify_args(args);
    launch_kernel(chained_launch_for(args.num_ranks), notify_kernel, 1, kNumThreadsPerBlock, 0, stream, args);
}

void barrier(const Peers& peers, int rank, int num_ranks, int* epoch, int64_t timeout_ns, int stage, const Published* publish,
             cudaStream_t stream, bool clear_input_error) {
    EP_HOST_ASSERT(num_ranks <= kMaxRanks && num_ranks <= kNumThreadsPerBlock, "num_ranks=", num_ranks);
    static_assert(kNumPublished <= kNumThreadsPerBlock, "one thread per published field");
    // One rank meets no peer: a barrier that neither publishes nor clears the input error would only advance the epoch
    // (which only barriers read), and stream order already does the rest.
    if (num_ranks == 1 && publish == nullptr && !clear_input_error) return;
    launch_kernel(chained_launch_for(num_ranks), barrier_kernel, 1, kNumThreadsPerBlock, 0, stream, peers, rank, num_ranks, epoch,
                  timeout_ns, stage, publish != nullptr ? *publish : Published{}, publish != nullptr, clear_input_error);
}

void dispatch(const Peers& peers, int rank, int num_ranks, const void* x, int x_row_bytes, const void* scales, int scale_row_bytes,
              const int64_t* topk_idx, const float* topk_weights, int num_topk, int num_local_experts, const bool* is_token_in_rank,
              const int* send_pos, const int* count_matrix, const ReceiverRegions* plan, const int* go, int num_tokens, int num_sms,
              cudaStream_t stream, bool clear_input_error) {
    EP_HOST_ASSERT(num_topk <= kMaxTopk && num_topk <= kWarpSize, "num_topk=", num_topk);
    EP_HOST_ASSERT(!clear_input_error || num_ranks == 1, "only one rank's dispatch kernel may clear the input error");
    // No tokens: no kernel, unless the input error must be cleared (then one block clears it and copies nothing).
    if (num_tokens == 0 && !clear_input_error) return;
    launch_kernel(chained_launch_for(num_ranks), dispatch_kernel, data_grid(num_sms, num_tokens), kDataThreadsPerBlock, 0, stream, peers,
                  rank, num_ranks, static_cast<const char*>(x), x_row_bytes, static_cast<const char*>(scales), scale_row_bytes, topk_idx,
                  topk_weights, num_topk, num_local_experts, is_token_in_rank, send_pos, count_matrix, plan, go, num_tokens,
                  clear_input_error);
}

void copy_out(const char* data, const DispatchRegions& regions, const int* count_matrix, int rank, int num_ranks, int rows_out,
              void* recv_x, int x_row_bytes, void* recv_scales, int scale_row_bytes, int64_t* recv_topk_idx, float* recv_topk_weights,
              int num_topk, int* recv_src_idx, int num_sms, cudaStream_t stream) {
    // Launched even for rows_out == 0: the kernel is what reports num_recv > rows_out.
    copy_out_kernel<<<data_grid(num_sms, rows_out), kDataThreadsPerBlock, 0, stream>>>(
        data, regions, count_matrix, rank, num_ranks, rows_out, static_cast<char*>(recv_x), x_row_bytes, static_cast<char*>(recv_scales),
        scale_row_bytes, recv_topk_idx, recv_topk_weights, num_topk, recv_src_idx);
    EP_CUDA_CHECK(cudaGetLastError());
}

void mark_padding(const int* count_matrix, int rank, int num_ranks, int rows_out, int* recv_src_idx, int64_t* recv_topk_idx,
                  float* recv_topk_weights, int num_topk, cudaStream_t stream) {
    if (rows_out == 0) return;
    const int grid = static_cast<int>(std::min<int64_t>(ceil_div<int64_t>(rows_out, kNumThreadsPerBlock), kMaxFinishBlocks));
    launch_kernel(chained_launch_for(num_ranks), mark_padding_kernel, grid, kNumThreadsPerBlock, 0, stream, count_matrix, rank, num_ranks,
                  rows_out, recv_src_idx, recv_topk_idx, recv_topk_weights, num_topk);
}

void combine_send(const Peers& peers, int rank, int num_ranks, const void* x, int x_row_bytes, const float* topk_weights, int num_topk,
                  const int* count_matrix, int num_sms, cudaStream_t stream) {
    launch_kernel(chained_launch_for(num_ranks), combine_send_kernel, num_sms, kDataThreadsPerBlock, 0, stream, peers, rank, num_ranks,
                  static_cast<const char*>(x), x_row_bytes, topk_weights, num_topk, count_matrix);
}

void combine_send_expert_major(const Peers& peers, int rank, int num_ranks, const void* y, int64_t num_rows, int hidden, FloatType type,
                               const int64_t* row_map, int map_topk, const float* topk_weights, int num_topk, const int* count_matrix,
                               int num_sms, cudaStream_t stream) {
    EP_HOST_ASSERT(map_topk <= kMaxTopk && map_topk <= kWarpSize, "row map top-k=", map_topk);
    with_float_type(type, [&](auto element) {
        using T = decltype(element);
        EP_HOST_ASSERT(hidden % Vec<T>::kElems == 0, "hidden=", hidden);
        combine_send_expert_major_kernel<T><<<num_sms, kDataThreadsPerBlock, 0, stream>>>(
            peers, rank, num_ranks, static_cast<const T*>(y), num_rows, hidden, row_map, map_topk, topk_weights, num_topk, count_matrix);
    });
    EP_CUDA_CHECK(cudaGetLastError());
}

void combine_reduce(const Peers& peers, const char* rows_x, const float* rows_weights, const void* local_x, const float* local_weights,
                    int rank, int num_ranks, const int* count_matrix, const bool* is_token_in_rank, const int* send_pos, int num_tokens,
                    int hidden, FloatType type, const void* bias0, const void* bias1, void* out, float* out_weights, int num_topk,
                    int num_sms, cudaStream_t stream) {
    if (num_tokens == 0) return;
    const int grid = data_grid(num_sms, num_tokens);
    with_float_type(type, [&](auto element) {
        using T = decltype(element);
        EP_HOST_ASSERT(hidden % Vec<T>::kElems == 0, "hidden=", hidden);
        launch_kernel(chained_launch_for(num_ranks), combine_reduce_kernel<T>, grid, kDataThreadsPerBlock, 0, stream, peers, rows_x,
                      rows_weights, static_cast<const char*>(local_x), local_weights, rank, num_ranks, count_matrix, is_token_in_rank,
                      send_pos, num_tokens, hidden, static_cast<const T*>(bias0), static_cast<const T*>(bias1), static_cast<T*>(out),
                      out_weights, num_topk);
    });
}


void expert_positions(const int64_t* topk_idx, const bool* is_token_in_rank, int num_tokens, int num_topk, int num_experts, int num_ranks,
                      int* pairs, int* expert_counts, cudaStream_t stream) {
    EP_HOST_ASSERT(num_experts > 0 && num_experts % num_ranks == 0, "num_experts=", num_experts, " num_ranks=", num_ranks);
    expert_positions_kernel<<<num_experts, kScanThreads, 0, stream>>>(topk_idx, is_token_in_rank, num_tokens, num_topk,
                                                                      num_experts / num_ranks, num_ranks, pairs, expert_counts);
    EP_CUDA_CHECK(cudaGetLastError());
}

void dispatch_expert_major(const Peers& peers, int rank, int num_ranks, const void* x, int x_row_bytes, const void* scales,
                           int scale_row_bytes, const int64_t* topk_idx, const float* topk_weights, int num_topk, int num_local_experts,
                           const bool* is_token_in_rank, const int* send_pos, const int* count_matrix, const int* slot_base, int* pairs,
                           int num_tokens, int num_sms, cudaStream_t stream) {
    EP_HOST_ASSERT(num_topk <= kMaxTopk && num_topk <= kWarpSize, "num_topk=", num_topk);
    if (num_tokens == 0) return;
    dispatch_expert_major_kernel<<<data_grid(num_sms, num_tokens), kDataThreadsPerBlock, 0, stream>>>(
        peers, rank, num_ranks, static_cast<const char*>(x), x_row_bytes, static_cast<const char*>(scales), scale_row_bytes, topk_idx,
        topk_weights, num_topk, num_local_experts, is_token_in_rank, send_pos, count_matrix, slot_base, pairs, num_tokens);
    EP_CUDA_CHECK(cudaGetLastError());
}

void expert_major_padding(const int* aligned_per_expert, const int* pairs_per_expert, int num_local_experts, void* x, int x_row_bytes,
                          void* scales, int scale_row_bytes, int64_t* row_pair, cudaStream_t stream) {
    if (num_local_experts == 0) return;
    expert_major_padding_kernel<<<num_local_experts, kNumThreadsPerBlock, 0, stream>>>(
        aligned_per_expert, pairs_per_expert, static_cast<char*>(x), x_row_bytes, static_cast<char*>(scales), scale_row_bytes, row_pair);
    EP_CUDA_CHECK(cudaGetLastError());
}

}  // namespace ep::intranode
