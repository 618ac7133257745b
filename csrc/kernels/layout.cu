// Dispatch layout kernels: see layout.cuh for the contract. Two paths:
//
// Owner kernel (pending: runs only with EP_DISPATCHER_PENDING_KERNELS=1, see pending_kernels.h; scope in layout.cuh).
// The call is host-bound (each launch or memset is several us of host time), so this path is one launch and no memset.
// Each of 8 blocks owns a contiguous range of the counter array [ranks | experts | nodes]: it counts into shared memory
// while walking ALL tokens, then stores its whole range, zeros included, with plain stores. No block adds into
// another's counters, so nothing needs a zero-fill and there are no global atomics (deterministic). Every block
// re-reads all of topk_idx, which is cheap from L2 at the scope's size; each block writes the is_token_in_rank rows
// of its own eighth of the tokens, from the rank mask it computed anyway. A warp loads its 32 tokens' entries
// coalesced (were each thread to read its own token's row, every warp load would touch 16 cache lines at top-8) and
// hands each thread its row's ranks through shared memory; the thread builds its token's rank mask, and the warp
// counts tokens per owned rank or node with one ballot each.
//
// Fallback kernel (every call outside the owner kernel's scope, and every call without the switch): each block owns
// a contiguous range of tokens. It first zeroes that range's rows of is_token_in_rank, then walks the range's top-k
// entries with one thread per entry, which keeps the int64 loads coalesced. A token is counted for a rank (or node) by
// the first of its entries that lands there; later entries of the same token check the entries before them in the row
// (O(num_topk^2) per token, cheap for the top-k sizes MoE routers use, and the row is in L1 by then). Counts go to
// per-block shared-memory counters and are added to the zero-filled global outputs once per block, which keeps global
// atomic traffic at O(blocks * counters) instead of O(entries).
#include <algorithm>
#include <cstdint>

#include "kernels/common.cuh"
#include "kernels/layout.cuh"
#include "kernels/pending_kernels.h"

namespace ep::layout {
namespace {

// Dynamic shared memory a block may use without the cudaFuncAttributeMaxDynamicSharedMemorySize opt-in; counter
// sets larger than this (roughly num_experts > 12k) fall back to global atomics.
constexpr int64_t kMaxSharedCounterBytes = 48 * 1024;

// Fewer entries than this per block and the fixed per-block cost (zeroing and flushing the counters, two
// barriers) outweighs the work, so small inputs get fewer, fuller blocks.
constexpr int kMinEntriesPerBlock = 2 * kNumThreadsPerBlock;

// Resident blocks per SM worth launching for large inputs: 4 x 8 warps hide load latency; more blocks would
// only add counter flushes (and 4 x 48 KiB of counters still fits Hopper's 228 KiB of shared memory).
constexpr int kMaxBlocksPerSm = 4;

// Width of the vector stores that zero is_token_in_rank rows.
constexpr int kZeroStoreBytes = static_cast<int>(sizeof(int4));

// The call's routing, as both kernels see it.
struct Routing {
    const int64_t* __restrict__ topk_idx;  // [num_tokens, num_topk]
    int num_tokens;
    int num_topk;
    int num_experts;
    int num_ranks;
    int num_ranks_per_node;
    int num_nodes;  // 0: no per-node output
};

struct LayoutParams : Routing {
    int num_local_experts;
    int tokens_per_block;
    int* num_tokens_per_rank;    // [num_ranks], zero-filled by the launcher
    int* num_tokens_per_node;    // [num_nodes] or nullptr
    int* num_tokens_per_expert;  // [num_experts], zero-filled by the launcher
    bool* is_token_in_rank;      // [num_tokens, num_ranks], zeroed here row range by row range
};

// The whole block zeroes dst[0, num_bytes): bytes up to the first 16-byte boundary, 16-byte stores, then the tail.
__device__ __forceinline__ void block_zero_bytes(uint8_t* dst, int64_t num_bytes) {
    const auto misalignment = static_cast<int64_t>(reinterpret_cast<uintptr_t>(dst) % kZeroStoreBytes);
    const int64_t head = min(num_bytes, (kZeroStoreBytes - misalignment) % kZeroStoreBytes);
    const int64_t num_vectors = (num_bytes - head) / kZeroStoreBytes;
    const int64_t tail_begin = head + num_vectors * kZeroStoreBytes;
    for (int64_t i = threadIdx.x; i < head; i += blockDim.x) dst[i] = 0;
    auto* vectors = reinterpret_cast<int4*>(dst + head);
    for (int64_t i = threadIdx.x; i < num_vectors; i += blockDim.x) vectors[i] = make_int4(0, 0, 0, 0);
    for (int64_t i = tail_begin + threadIdx.x; i < num_bytes; i += blockDim.x) dst[i] = 0;
}

template <bool kSharedCounters>
__global__ void __launch_bounds__(kNumThreadsPerBlock) get_dispatch_layout_kernel(const LayoutParams p) {
    // Layout: [num_experts | num_ranks | num_nodes], the same order as the flush below.
    extern __shared__ int shared_counters[];
    const int num_counters = p.num_experts + p.num_ranks + p.num_nodes;
    int* expert_counters = p.num_tokens_per_expert;
    int* rank_counters = p.num_tokens_per_rank;
    int* node_counters = p.num_tokens_per_node;
    if constexpr (kSharedCounters) {
        expert_counters = shared_counters;
        rank_counters = shared_counters + p.num_experts;
        node_counters = shared_counters + p.num_experts + p.num_ranks;
    }

    const int token_begin = static_cast<int>(blockIdx.x) * p.tokens_per_block;
    const int token_end = static_cast<int>(min(int64_t{p.num_tokens}, int64_t{token_begin} + p.tokens_per_block));
    // Uniform for the whole block, so the barriers below are never split. The grid is sized so this does not
    // happen; the guard keeps a mis-sized launch from writing out of bounds.
    if (token_begin >= token_end) return;

    block_zero_bytes(reinterpret_cast<uint8_t*>(p.is_token_in_rank) + static_cast<int64_t>(token_begin) * p.num_ranks,
                     static_cast<int64_t>(token_end - token_begin) * p.num_ranks);
    if constexpr (kSharedCounters) {
        for (int i = threadIdx.x; i < num_counters; i += blockDim.x) shared_counters[i] = 0;
    }
    // Orders the zeroing above (rows and shared counters) before the flag stores and counter increments below,
    // which other threads of this block make. Rows of other blocks are disjoint, so no grid-wide ordering is needed.
    __syncthreads();

    // The loop counter is 64-bit so that the last increment cannot overflow; every visited entry fits in int32
    // (the launcher checks num_tokens * num_topk), so the divisions below stay 32-bit.
    const int64_t entry_end = int64_t{token_end} * p.num_topk;
    for (int64_t entry_64 = int64_t{token_begin} * p.num_topk + threadIdx.x; entry_64 < entry_end; entry_64 += blockDim.x) {
        const int entry = static_cast<int>(entry_64);
        const int64_t expert = p.topk_idx[entry];
        if (expert < 0 || expert >= p.num_experts) continue;
        const int token = entry / p.num_topk;
        const int k = entry - token * p.num_topk;
        const int rank = static_cast<int>(expert) / p.num_local_experts;
        const int node = rank / p.num_ranks_per_node;
        atomicAdd(expert_counters + expert, 1);

        // Only the first entry of this token that reaches `rank` (or `node`) counts it, so counts are per token.
        bool first_on_rank = true;
        bool first_on_node = p.num_nodes > 0;
        const int64_t* row = p.topk_idx + (entry - k);
        for (int j = 0; j < k && (first_on_rank || first_on_node); ++j) {
            const int64_t other = row[j];
            if (other < 0 || other >= p.num_experts) continue;
            const int other_rank = static_cast<int>(other) / p.num_local_experts;
            first_on_rank = first_on_rank && other_rank != rank;
            first_on_node = first_on_node && other_rank / p.num_ranks_per_node != node;
        }
        if (first_on_rank) {
            p.is_token_in_rank[static_cast<int64_t>(token) * p.num_ranks + rank] = true;
            atomicAdd(rank_counters + rank, 1);
        }
        if (first_on_node) atomicAdd(node_counters + node, 1);
    }

    if constexpr (kSharedCounters) {
        // All of this block's increments must have landed in shared memory before they are read for the flush.
        __syncthreads();
        for (int i = threadIdx.x; i < num_counters; i += blockDim.x) {
            const int count = shared_counters[i];
            // Zero counts are skipped to save global atomics; the launcher zero-filled the outputs.
            if (count == 0) continue;
            int* target = i < p.num_experts                 ? p.num_tokens_per_expert + i
                          : i < p.num_experts + p.num_ranks ? p.num_tokens_per_rank + (i - p.num_experts)
                                                            : p.num_tokens_per_node + (i - p.num_experts - p.num_ranks);
            atomicAdd(target, count);
        }
    }
}

// ------------------------------------------------------------------ owner kernel (pending)

// Blocks of the owner kernel: enough to split the counters and the is_token_in_rank rows 8 ways, few enough that every
// block re-reading all of topk_idx (at most kOwnerMaxEntries x 8 B = 512 KiB each) stays cheap from L2.
constexpr int kOwnerNumBlocks = 8;
// One thread per token in the counting phase: 4096 tokens take each warp 4 steps.
constexpr int kOwnerThreadsPerBlock = 1024;
// Two blocks' registers fit an SM (32 per thread), so the kernel can share an SM with a neighbour kernel's block.
constexpr int kOwnerMinBlocksPerSm = 2;
constexpr int kOwnerWarpsPerBlock = kOwnerThreadsPerBlock / kWarpSize;
// Top-k loads a lane has in flight at once: 4 x 8 B overlap the L2 latency within 32 registers (8 would spill).
constexpr int kOwnerLoadBatch = 4;
// Scope: the top-k entries every block re-reads (also keeps token * num_ranks and every index in int32).
constexpr int64_t kOwnerMaxEntries = 65536;
// Scope: a token's ranks, and its nodes, are bits of a uint64.
constexpr int kOwnerMaxRanks = 64;
// A block's share of the counters when all of them fit kMaxSharedCounterBytes (the scope).
constexpr int kOwnerMaxCountersPerBlock = static_cast<int>(ceil_div<int64_t>(kMaxSharedCounterBytes / sizeof(int), kOwnerNumBlocks));
// A warp's count of one ballot counter is a 16-bit half of a register (see the counting loop).
constexpr int kBallotCountBits = 16;
constexpr uint32_t kBallotCountMask = (1u << kBallotCountBits) - 1;
static_assert(kOwnerMaxEntries / kOwnerThreadsPerBlock * kWarpSize <= kBallotCountMask, "a warp's count must fit 16 bits");
// Rank of an entry outside [0, num_experts) in the shared-memory turnaround (ranks are < kOwnerMaxRanks).
constexpr uint8_t kOwnerNoRank = 0xff;
// Widest store of an is_token_in_rank row piece: 8 flags from 8 bits of the rank mask.
constexpr int kOwnerMaxStoreBytes = static_cast<int>(sizeof(uint64_t));
// Shift of the division by multiplication (make_magic) of an expert (< 2^14 in the scope) by the experts per rank
// (< 2^14): their product stays below 2^31, and the multiplier ceil(2^31 / d) fits 32 bits.
constexpr int kRankMagicShift = 31;
// Staged ranks a thread reads at once when num_topk is a multiple of it (one 32-bit shared load).
constexpr int kOwnerRanksPerWord = static_cast<int>(sizeof(uint32_t));

struct OwnerLayoutParams : Routing {
    uint32_t rank_magic;      // expert / num_local_experts == (expert * rank_magic) >> kRankMagicShift
    uint64_t node_rank_bits;  // the low num_ranks_per_node bits (a node's ranks in the rank mask)
    int row_store_bytes;      // 1, 2, 4 or 8: divides num_ranks and the alignment of is_token_in_rank
    int* counters;            // [num_ranks | num_experts | num_nodes], every element stored here
    bool* is_token_in_rank;   // [num_tokens, num_ranks], every row stored here
};

// ceil(2^shift / divisor): with it, n / divisor == (n * magic) >> shift whenever n * divisor <= 2^shift, because the
// excess n * (magic * divisor - 2^shift) / (divisor * 2^shift) then stays below 1 / divisor (a multiply and a shift
// instead of a division, per entry).
uint64_t make_magic(int divisor, int shift) { return ((uint64_t{1} << shift) + divisor - 1) / divisor; }

// Byte i of the result is bit i of `bits`, as 0 or 1: the multiply copies the low 8 bits into every byte, the AND keeps
// bit i in byte i, and adding 0x7f to a byte of 0 or 1 << i sets its top bit exactly when bit i is set (no carry out).
__device__ __forceinline__ uint64_t bits_to_bytes(uint64_t bits) {
    constexpr uint64_t kEveryByte = 0x0101010101010101ull;
    const uint64_t kept = ((bits & 0xff) * kEveryByte) & 0x8040201008040201ull;
    return ((kept + 0x7f7f7f7f7f7f7f7full) >> 7) & kEveryByte;
}

// The rank-mask bit of a staged rank; none for kOwnerNoRank.
__device__ __forceinline__ uint64_t rank_bit(uint32_t rank) { return rank < kOwnerMaxRanks ? uint64_t{1} << rank : 0; }

// All num_ranks flags of one row, `store_bytes` at a time (the row start is aligned to it, see the launcher).
__device__ __forceinline__ void store_row(bool* row, uint64_t rank_mask, int num_ranks, int store_bytes) {
    for (int rank = 0; rank < num_ranks; rank += store_bytes) {
        const uint64_t flags = bits_to_bytes(rank_mask >> rank);
        if (store_bytes == 8) {
            *reinterpret_cast<uint64_t*>(row + rank) = flags;
        } else if (store_bytes == 4) {
            *reinterpret_cast<uint32_t*>(row + rank) = static_cast<uint32_t>(flags);
        } else if (store_bytes == 2) {
            *reinterpret_cast<uint16_t*>(row + rank) = static_cast<uint16_t>(flags);
        } else {
            *reinterpret_cast<uint8_t*>(row + rank) = static_cast<uint8_t>(flags);
        }
    }
}

__global__ void __launch_bounds__(kOwnerThreadsPerBlock, kOwnerMinBlocksPerSm) owner_layout_kernel(const OwnerLayoutParams p) {
    __shared__ int owned_counters[kOwnerMaxCountersPerBlock];
    // Per warp, the ranks of its 32 tokens' entries in topk_idx's order ([token][k]), so that the loads below write
    // them without any index arithmetic; a thread reads its row 4 ranks at a time where num_topk allows (at top-8,
    // two 32-bit loads with a 2-way bank conflict).
    __shared__ alignas(kOwnerRanksPerWord) uint8_t warp_ranks[kOwnerWarpsPerBlock][kMaxTopk * kWarpSize];

    const int num_counters = p.num_ranks + p.num_experts + p.num_nodes;
    const int block = static_cast<int>(blockIdx.x);
    const int counter_begin = num_counters * block / kOwnerNumBlocks;
    const int counter_end = num_counters * (block + 1) / kOwnerNumBlocks;
    const int num_owned = counter_end - counter_begin;
    for (int i = threadIdx.x; i < num_owned; i += kOwnerThreadsPerBlock) owned_counters[i] = 0;

    // Owned ranks are counters [counter_begin, counter_begin + num_owned_ranks); owned nodes start at counter
    // node_counter_begin. Ballot counter i is owned rank i, then owned node i - num_owned_ranks. There are at most 64:
    // at most 64 ranks or 64 nodes, and never both, since a block's ceil(C / 8) of the C <= 3 * num_experts counters
    // cannot span all the experts between the ranks and the nodes.
    const int num_owned_ranks = max(0, min(counter_end, p.num_ranks) - counter_begin);
    const int node_counter_begin = max(counter_begin, p.num_ranks + p.num_experts);
    const int num_ballot_counters = num_owned_ranks + max(0, counter_end - node_counter_begin);
    const int first_owned_node = node_counter_begin - (p.num_ranks + p.num_experts);
    const int token_slice_begin = p.num_tokens * block / kOwnerNumBlocks;
    const int token_slice_end = p.num_tokens * (block + 1) / kOwnerNumBlocks;
    // The zeroed counters must be visible to every warp before its first atomicAdd.
    __syncthreads();

    const int lane = threadIdx.x % kWarpSize;
    uint8_t* staged_ranks = warp_ranks[threadIdx.x / kWarpSize];
    // This warp's counts of ballot counters `lane` (low half) and `lane + 32` (high half): a warp sees at most
    // kOwnerMaxEntries / kOwnerThreadsPerBlock * 32 = 2048 tokens, so a half never carries into the other.
    uint32_t ballot_counts = 0;
    // Warp-uniform bound (a warp's first token), so all 32 lanes reach every ballot below.
    for (int warp_token = threadIdx.x - lane; warp_token < p.num_tokens; warp_token += kOwnerThreadsPerBlock) {
        // Coalesced loads of the warp's entries, kOwnerLoadBatch per lane in flight; each entry is counted for its
        // expert here, and its rank staged.
        const int64_t* warp_entries = p.topk_idx + warp_token * p.num_topk;
        const int num_warp_entries = min(kWarpSize, p.num_tokens - warp_token) * p.num_topk;
        for (int batch = lane; batch < num_warp_entries; batch += kOwnerLoadBatch * kWarpSize) {
            int64_t experts[kOwnerLoadBatch];
#pragma unroll
            for (int b = 0; b < kOwnerLoadBatch; ++b) {
                const int j = batch + b * kWarpSize;
                experts[b] = j < num_warp_entries ? __ldg(warp_entries + j) : -1;
            }
#pragma unroll
            for (int b = 0; b < kOwnerLoadBatch; ++b) {
                const int j = batch + b * kWarpSize;
                if (j >= num_warp_entries) break;
                uint8_t rank = kOwnerNoRank;
                if (experts[b] >= 0 && experts[b] < p.num_experts) {
                    const auto expert = static_cast<uint32_t>(experts[b]);
                    rank = static_cast<uint8_t>((uint64_t{expert} * p.rank_magic) >> kRankMagicShift);
                    // Expert e is counter num_ranks + e; the unsigned compare tests both ends of the owned range.
                    const auto owned = static_cast<unsigned>(p.num_ranks + static_cast<int>(expert) - counter_begin);
                    if (owned < static_cast<unsigned>(num_owned)) atomicAdd(owned_counters + owned, 1);
                }
                staged_ranks[j] = rank;
            }
        }
        // The staged ranks of other lanes are read below.
        __syncwarp();

        const int token = warp_token + lane;
        uint64_t rank_mask = 0;  // stays empty past the last token, so those lanes add nothing to the ballots
        if (token < p.num_tokens) {
            const uint8_t* ranks = staged_ranks + lane * p.num_topk;
            if (p.num_topk % kOwnerRanksPerWord == 0) {
                for (int k = 0; k < p.num_topk; k += kOwnerRanksPerWord) {
                    const uint32_t word = *reinterpret_cast<const uint32_t*>(ranks + k);
#pragma unroll
                    for (int b = 0; b < kOwnerRanksPerWord; ++b) rank_mask |= rank_bit((word >> (8 * b)) & 0xff);
                }
            } else {
                for (int k = 0; k < p.num_topk; ++k) rank_mask |= rank_bit(ranks[k]);
            }
            if (token >= token_slice_begin && token < token_slice_end) {
                store_row(p.is_token_in_rank + token * p.num_ranks, rank_mask, p.num_ranks, p.row_store_bytes);
            }
        }
        // Every lane has read its ranks before the next step stages new ones over them.
        __syncwarp();

        for (int i = 0; i < num_ballot_counters; ++i) {
            const bool counted =
                i < num_owned_ranks
                    ? ((rank_mask >> (counter_begin + i)) & 1) != 0
                    : ((rank_mask >> ((first_owned_node + i - num_owned_ranks) * p.num_ranks_per_node)) & p.node_rank_bits) != 0;
            const int count = __popc(__ballot_sync(kFullWarpMask, counted));
            if (lane == i % kWarpSize) ballot_counts += count << (i < kWarpSize ? 0 : kBallotCountBits);
        }
    }

    // Ballot counter i lives at owned_counters[i] (a rank) or after the owned experts (a node).
    const int node_shift = node_counter_begin - counter_begin - num_owned_ranks;
    for (int i = lane; i < num_ballot_counters; i += kWarpSize) {
        const int count = i < kWarpSize ? ballot_counts & kBallotCountMask : ballot_counts >> kBallotCountBits;
        atomicAdd(owned_counters + i + (i < num_owned_ranks ? 0 : node_shift), count);
    }
    // Every warp's increments must have landed before the range is stored.
    __syncthreads();
    for (int i = threadIdx.x; i < num_owned; i += kOwnerThreadsPerBlock) p.counters[counter_begin + i] = owned_counters[i];
}

// Whether the owner kernel covers a call: the entries every block re-reads, the rank and node masks, a block's top-k
// turnaround and a block's share of the counters are within its bounds (num_topk == 0 still bounds the tokens).
bool owner_kernel_covers(int num_tokens, int num_topk, int num_ranks, int num_nodes, int64_t num_counters) {
    return int64_t{num_tokens} * std::max(num_topk, 1) <= kOwnerMaxEntries && num_topk <= kMaxTopk && num_ranks <= kOwnerMaxRanks &&
           num_nodes <= kOwnerMaxRanks && num_counters * static_cast<int64_t>(sizeof(int)) <= kMaxSharedCounterBytes;
}

void launch_owner_kernel(const Routing& routing, int* counters, bool* is_token_in_rank, cudaStream_t stream) {
    const int num_ranks = routing.num_ranks, num_ranks_per_node = routing.num_ranks_per_node;
    // Row t starts at byte t * num_ranks, so a store width that divides num_ranks and the base alignment keeps every
    // store aligned (the C++ entry hands a 16-byte aligned base).
    const auto flags_address = reinterpret_cast<uintptr_t>(is_token_in_rank);
    int row_store_bytes = kOwnerMaxStoreBytes;
    while (row_store_bytes > 1 && (num_ranks % row_store_bytes != 0 || flags_address % row_store_bytes != 0)) row_store_bytes /= 2;

    OwnerLayoutParams params{};
    static_cast<Routing&>(params) = routing;
    params.rank_magic = static_cast<uint32_t>(make_magic(routing.num_experts / num_ranks, kRankMagicShift));
    // A caller may ask for the per-node output of one node of 64 ranks (num_ranks_per_node == num_ranks).
    params.node_rank_bits = num_ranks_per_node >= kOwnerMaxRanks ? ~uint64_t{0} : (uint64_t{1} << num_ranks_per_node) - 1;
    params.row_store_bytes = row_store_bytes;
    params.counters = counters;
    params.is_token_in_rank = is_token_in_rank;
    owner_layout_kernel<<<kOwnerNumBlocks, kOwnerThreadsPerBlock, 0, stream>>>(params);
    EP_CUDA_CHECK(cudaGetLastError());
}

}  // namespace

void get_dispatch_layout(const int64_t* topk_idx, int num_tokens, int num_topk, int num_experts, int num_ranks, int num_ranks_per_node,
                         int* num_tokens_per_rank, int* num_tokens_per_rdma_rank, int* num_tokens_per_expert, bool* is_token_in_rank,
                         int num_sms, cudaStream_t stream) {
    EP_HOST_ASSERT(num_tokens >= 0 && num_topk >= 0, "num_tokens=", num_tokens, " num_topk=", num_topk);
    EP_HOST_ASSERT(num_ranks > 0 && num_experts > 0 && num_experts % num_ranks == 0, "num_experts=", num_experts,
                   " must be a positive multiple of num_ranks=", num_ranks);
    EP_HOST_ASSERT(num_ranks_per_node > 0, "num_ranks_per_node=", num_ranks_per_node);
    EP_HOST_ASSERT(num_tokens_per_rdma_rank == nullptr || num_ranks % num_ranks_per_node == 0, "num_ranks=", num_ranks,
                   " must be a multiple of num_ranks_per_node=", num_ranks_per_node);
    EP_HOST_ASSERT(static_cast<int64_t>(num_tokens) * std::max(num_topk, num_ranks) <= INT32_MAX,
                   "num_tokens * max(num_topk, num_ranks) must fit in int32");
    EP_HOST_ASSERT(num_sms > 0, "num_sms=", num_sms);
    const int num_nodes = num_tokens_per_rdma_rank != nullptr ? num_ranks / num_ranks_per_node : 0;

    // Both kernels address the counters as one array ([ranks | experts | nodes], see layout.cuh): the owner kernel's
    // blocks own ranges of it, the fallback zeroes it with one memset.
    EP_HOST_ASSERT(num_tokens_per_expert == num_tokens_per_rank + num_ranks &&
                       (num_nodes == 0 || num_tokens_per_rdma_rank == num_tokens_per_expert + num_experts),
                   "the counters must be one array: [num_tokens_per_rank | num_tokens_per_expert | num_tokens_per_rdma_rank]");
    const int64_t num_counters = int64_t{num_ranks} + num_experts + num_nodes;
    const Routing routing{topk_idx, num_tokens, num_topk, num_experts, num_ranks, num_ranks_per_node, num_nodes};
    if (pending_kernels_enabled() && owner_kernel_covers(num_tokens, num_topk, num_ranks, num_nodes, num_counters)) {
        launch_owner_kernel(routing, num_tokens_per_rank, is_token_in_rank, stream);
        return;
    }

    // Fallback: blocks accumulate into the counters with atomics, so they start from zero; memset nodes are
    // graph-capturable.
    EP_CUDA_CHECK(cudaMemsetAsync(num_tokens_per_rank, 0, sizeof(int) * num_counters, stream));
    if (num_tokens == 0) return;  // is_token_in_rank is empty

    const int tokens_per_block_for_grid = ceil_div(num_tokens, num_sms * kMaxBlocksPerSm);
    const int tokens_per_block_for_work = num_topk > 0 ? ceil_div(kMinEntriesPerBlock, num_topk) : 1;
    const int tokens_per_block = std::min(num_tokens, std::max(tokens_per_block_for_grid, tokens_per_block_for_work));
    const int num_blocks = ceil_div(num_tokens, tokens_per_block);

    LayoutParams params{};
    static_cast<Routing&>(params) = routing;
    params.num_local_experts = num_experts / num_ranks;
    params.tokens_per_block = tokens_per_block;
    params.num_tokens_per_rank = num_tokens_per_rank;
    params.num_tokens_per_node = num_tokens_per_rdma_rank;
    params.num_tokens_per_expert = num_tokens_per_expert;
    params.is_token_in_rank = is_token_in_rank;

    const int64_t shared_counter_bytes = static_cast<int64_t>(sizeof(int)) * num_counters;
    if (shared_counter_bytes <= kMaxSharedCounterBytes) {
        get_dispatch_layout_kernel<true><<<num_blocks, kNumThreadsPerBlock, static_cast<size_t>(shared_counter_bytes), stream>>>(params);
    } else {
        get_dispatch_layout_kernel<false><<<num_blocks, kNumThreadsPerBlock, 0, stream>>>(params);
    }
    EP_CUDA_CHECK(cudaGetLastError());
}

}  // namespace ep::layout
