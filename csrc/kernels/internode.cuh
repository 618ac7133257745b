// Internode high-throughput dispatch/combine over one NVSHMEM symmetric buffer per rank.
//
// Ranks form nodes of P consecutive ranks (rank r = node n * P + local index l). A token crosses the RDMA leg
// at most once per destination node, always to the rank with the same local index there (its "forwarder"),
// which forwards it over NVLink to the destination ranks of its node. Cross-node bytes move only through
// NVSHMEM puts and signals (public device API: every transport works); intra-node bytes use direct stores
// through nvshmem_ptr mappings.
//
// Like the intranode engine, every token is written once to its final row: the count exchange (notify) gives
// every rank the full count matrix M[src][dst] and the per-node counts, so a forwarder computes the destination
// row (sum_{s<src} M[s][dst] + position of the token among src's tokens for dst). The phases are separate kernels
// separated by timed all-rank barriers, so only one-block kernels ever spin: no co-residency requirement between
// ranks' data kernels, whatever num_sms is.
//   dispatch: notify -> rdma_send (stage each token once, put it to each remote node's forwarder) -> barrier
//             -> forward (own tokens and received messages to the node's ranks' receive rows) -> barrier
//             -> copy out of the receive rows into torch tensors.
//   combine : barrier -> nvl_send (each row to the forwarder of its source, on this node) -> barrier
//             -> forward (per token: fp32 sum over the node's ranks ascending, rounded to the output type; put to
//             the source's rank) -> barrier -> reduce (bias0 + bias1 + node partials by node ascending, fp32,
//             rounded once). ep_dispatcher.backends.reference implements the same order for multi-node groups.
// Signals are 64-bit counters incremented by NVSHMEM_SIGNAL_ADD (one per barrier/notify), waited with ">= epoch":
// never reset, robust to reordering. The notify count area is double-buffered by call parity so a rank that runs
// ahead cannot overwrite counts a slower rank is still reading.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "constants.h"

namespace ep::internode {

constexpr int kMaxRanks = 128;          // shared-memory tables in the kernels (per-(node, local rank) bases)
constexpr int kMaxRanksPerNode = 32;    // one warp lane per local destination rank
constexpr int kMaxLocalExperts = 1024;  // per-expert counts a notify slot holds

// Offsets inside one rank's symmetric buffer. The signal part depends on (R, P) only, so barrier counters survive
// calls of other shapes; the data part is laid out for hidden_bytes (= hidden * max(element_size, 2)) and
// max_tokens (tokens per rank). Dispatch and combine regions overlap: a barrier starts every call.
// The one source of these sizes: Python reads them through _C.internode_layout (ep_dispatcher/config.py); the
// reference backend's copy of the arithmetic (backends/reference_layout.py) serves only without the extension.
struct Layout {
    int num_ranks, num_ranks_per_node, num_nodes, max_tokens;
    int64_t hidden_bytes;
    int64_t notify_slot_ints;  // R + N + 1 + kMaxLocalExperts int32 per (source) slot
    int64_t msg_stride;        // one staged/received token message (worst case for hidden_bytes)
    int64_t recv_row_max;      // one final receive row, all fields (worst case)
    int64_t comb_stride_max;   // one combine row: x + top-k weights (worst case)
    int64_t signal_offset, notify_area_offset, notify_stage_offset, data_offset;
    int64_t send_stage_offset, rdma_recv_offset, recv_offset, recv_bytes;
    int64_t comb_nvl_offset, comb_rdma_offset, comb_stage_offset;
    int64_t total_bytes;
};

Layout make_layout(int64_t hidden_bytes, int num_ranks, int num_ranks_per_node, int max_tokens);
// Largest max_tokens whose layout fits in num_bytes (0 if none).
int max_tokens_for(int64_t num_bytes, int64_t hidden_bytes, int num_ranks, int num_ranks_per_node);

struct State {
    unsigned long long epoch;         // barriers + notifies this rank has passed
    unsigned long long notify_count;  // notifies so far (parity picks the count area)
};

// What every kernel needs: this rank's buffer, its node peers' direct mappings, the device state.
struct Ctx {
    uint8_t* local;
    uint8_t* peer[kMaxRanksPerNode];  // node peer j's buffer (index = local rank), mapped here
    int rank, num_ranks, per_node, num_nodes, node, local_rank;
    State* state;
    int64_t timeout_ns;
};

// Per-call field layout of messages and combine rows.
struct Fields {
    int x_bytes, scale_bytes, num_topk;
    int64_t off_scales, off_topk, off_weights, off_src, off_pos, msg_bytes;  // inside a message
    int64_t comb_bytes;                                                      // combine row: x then fp32 weights
};
Fields make_fields(const Layout& L, int x_bytes, int scale_bytes, int num_topk);

void barrier(const Layout& L, const Ctx& c, int stage, cudaStream_t stream);

// count_matrix[R*R] (row = source), node_count[R*N] (tokens source sends to node n), tokens_of[R] (each rank's
// num_tokens, so that every rank can check the buffer's limit for all), recv_per_expert[E_local] (aligned; skipped when
// num_tokens_per_expert is null).
void notify(const Layout& L, const Ctx& c, const int* num_tokens_per_rank, const int* num_tokens_per_node, int num_tokens,
            const int* num_tokens_per_expert, int num_experts, int expert_alignment, int* count_matrix, int* node_count,
            int* tokens_of, int* recv_per_expert, cudaStream_t stream);

// send_pos[T*R]: position of token t among this rank's tokens for rank d, -1 if not sent there;
// rdma_send_pos[T*N]: likewise per node. fwd_pos[N * fwd_stride * P] (may be null): filled for the combine.
void dispatch(const Layout& L, const Ctx& c, const Fields& F, const void* x, const void* scales, const int64_t* topk_idx,
              const float* topk_weights, int num_local_experts, const int* send_pos, const int* rdma_send_pos,
              const int* count_matrix, const int* node_count, int num_tokens, int* fwd_pos, int fwd_stride, int recv_capacity,
              int64_t recv_x_offset, int64_t recv_scales_offset, int64_t recv_topk_offset, int64_t recv_weights_offset,
              int64_t recv_src_offset, int num_sms, cudaStream_t stream);

// Cached dispatch has no notify to order it after every rank's previous call: this barrier does.
void cached_dispatch_start(const Layout& L, const Ctx& c, cudaStream_t stream);

void combine(const Layout& L, const Ctx& c, const Fields& F, FloatType type, const void* x, const float* topk_weights,
             const void* bias0, const void* bias1, const int* rdma_send_pos, const int* count_matrix, const int* node_count,
             const int* fwd_pos, int fwd_stride, int num_tokens, void* out, float* out_weights, int num_sms, cudaStream_t stream);

}  // namespace ep::internode
