// Dispatch layout: from the router's top-k expert choice, how many tokens go to each rank, node and expert,
// and which (token, rank) pairs exist. Host launcher only; the kernels live in layout.cu.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace ep::layout {

// Computes, on `stream` and without any host synchronisation (CUDA-graph capturable):
//   num_tokens_per_rank[r]      tokens with at least one expert on rank r (each token counted once per rank)
//   num_tokens_per_rdma_rank[n] tokens with at least one expert on a rank of node n (once per node);
//                               pass nullptr to skip it (single-node case)
//   num_tokens_per_expert[e]    (token, k) entries equal to e
//   is_token_in_rank[t * num_ranks + r]  token t has an expert on rank r
// topk_idx is [num_tokens, num_topk] row-major int64; entries outside [0, num_experts) (the -1 "no expert"
// marker, and out-of-range ids, which the host cannot see without a sync) are ignored.
// Expert e lives on rank e / (num_experts / num_ranks); rank r is on node r / num_ranks_per_node.
// The three counter arrays are one allocation, back to back: [num_tokens_per_rank | num_tokens_per_expert |
// num_tokens_per_rdma_rank] (the owner kernel's blocks own ranges of it; the fallback zero-fills it with one memset).
// Every element of every output is written, so outputs may come straight from a caching allocator. Integer
// counting makes the results deterministic.
// Two paths (layout.cu says how each works):
//   owner kernel: one launch, no memset (each launch or memset is several us of host time, and the call is
//     host-bound). Pending: taken only with EP_DISPATCHER_PENDING_KERNELS=1 (pending_kernels.h), and only within
//     its scope: num_tokens * max(num_topk, 1) <= 65536 (every block re-reads all of topk_idx), num_topk <= 16
//     (kMaxTopk: a warp's staged ranks), num_ranks <= 64 and nodes <= 64 (uint64 masks), and the counters within
//     48 KiB (num_ranks + num_experts + nodes <= 12288, shared memory).
//   fallback: a memset of the counters and one kernel with global atomics; every other call, any size.
// Preconditions (checked by the caller): num_tokens * max(num_topk, num_ranks) fits in int32,
// num_experts % num_ranks == 0, and num_ranks % num_ranks_per_node == 0 when num_tokens_per_rdma_rank is given.
void get_dispatch_layout(const int64_t* topk_idx, int num_tokens, int num_topk, int num_experts, int num_ranks, int num_ranks_per_node,
                         int* num_tokens_per_rank, int* num_tokens_per_rdma_rank, int* num_tokens_per_expert, bool* is_token_in_rank,
                         int num_sms, cudaStream_t stream);

}  // namespace ep::layout
