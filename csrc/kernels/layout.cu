// Dispatch layout kernel: see layout.cuh for the contract.
//
// Work split: each block owns a contiguous range of tokens. It first zeroes that range's rows of
// is_token_in_rank (so no separate memset is needed for the largest output), then walks the range's top-k
// entries with one thread per entry, which keeps the int64 loads coalesced. A token is counted for a rank
// (or node) by the first of its entries that lands there; later entries of the same token check the entries
// before them in the row (O(num_topk^2) per token, cheap for the top-k sizes MoE routers use, and the row is
// in L1 by then). Counts go to per-block shared-memory counters and are added to the global outputs once per
// block, which keeps global atomic traffic at O(blocks * counters) instead of O(entries).
#include <algorithm>
#include <cstdint>

#include "kernels/common.cuh"
#include "kernels/layout.cuh"

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

struct LayoutParams {
    const int64_t* __restrict__ topk_idx;  // [num_tokens, num_topk]
    int num_tokens;
    int num_topk;
    int num_experts;
    int num_local_experts;
    int num_ranks;
    int num_ranks_per_node;
    int num_nodes;  // 0: no per-node output
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

    // Blocks accumulate into the counters with atomics, so they start from zero; memset nodes are graph-capturable.
    // The counters lie back to back ([ranks | experts | nodes], see layout.cuh), so one memset zeroes them all.
    EP_HOST_ASSERT(num_tokens_per_expert == num_tokens_per_rank + num_ranks &&
                       (num_nodes == 0 || num_tokens_per_rdma_rank == num_tokens_per_expert + num_experts),
                   "the counters must be one array: [num_tokens_per_rank | num_tokens_per_expert | num_tokens_per_rdma_rank]");
    EP_CUDA_CHECK(cudaMemsetAsync(num_tokens_per_rank, 0, sizeof(int) * (int64_t{num_ranks} + num_experts + num_nodes), stream));
    if (num_tokens == 0) return;  // is_token_in_rank is empty

    const int tokens_per_block_for_grid = ceil_div(num_tokens, num_sms * kMaxBlocksPerSm);
    const int tokens_per_block_for_work = num_topk > 0 ? ceil_div(kMinEntriesPerBlock, num_topk) : 1;
    const int tokens_per_block = std::min(num_tokens, std::max(tokens_per_block_for_grid, tokens_per_block_for_work));
    const int num_blocks = ceil_div(num_tokens, tokens_per_block);

    LayoutParams params{};
    params.topk_idx = topk_idx;
    params.num_tokens = num_tokens;
    params.num_topk = num_topk;
    params.num_experts = num_experts;
    params.num_local_experts = num_experts / num_ranks;
    params.num_ranks = num_ranks;
    params.num_ranks_per_node = num_ranks_per_node;
    params.num_nodes = num_nodes;
    params.tokens_per_block = tokens_per_block;
    params.num_tokens_per_rank = num_tokens_per_rank;
    params.num_tokens_per_node = num_tokens_per_rdma_rank;
    params.num_tokens_per_expert = num_tokens_per_expert;
    params.is_token_in_rank = is_token_in_rank;

    const int64_t shared_counter_bytes = static_cast<int64_t>(sizeof(int)) * (int64_t{num_experts} + num_ranks + num_nodes);
    if (shared_counter_bytes <= kMaxSharedCounterBytes) {
        get_dispatch_layout_kernel<true><<<num_blocks, kNumThreadsPerBlock, static_cast<size_t>(shared_counter_bytes), stream>>>(params);
    } else {
        get_dispatch_layout_kernel<false><<<num_blocks, kNumThreadsPerBlock, 0, stream>>>(params);
    }
    EP_CUDA_CHECK(cudaGetLastError());
}

}  // namespace ep::layout
