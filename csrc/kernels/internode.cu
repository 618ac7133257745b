// Internode kernels: see internode.cuh for the design, the phases and the buffer layout.

#include "kernels/nvshmem_device.cuh"  // first: it re-enables the half/bf16 operators NVSHMEM needs

#include "kernels/internode.cuh"

#include <algorithm>

#include "kernels/common.cuh"
#include "kernels/constants.h"
#include "kernels/copy.cuh"
#include "kernels/sync.cuh"
#include "kernels/vec.cuh"

namespace ep::internode {
namespace {

constexpr int kSyncThreads = kNumThreadsPerBlock;  // notify / barrier: one thread per peer (looping beyond 256 ranks)

// ------------------------------------------------------------------ NVSHMEM wrappers (no-ops without NVSHMEM: the
// buffer cannot be created then, so these kernels never run)
__device__ __forceinline__ void signal_add(uint64_t* sig, int pe) {
#ifdef EP_DISPATCHER_WITH_NVSHMEM
    nvshmemx_signal_op(sig, 1, NVSHMEM_SIGNAL_ADD, pe);
#endif
}

__device__ __forceinline__ void put_with_signal(void* dst, const void* src, size_t bytes, uint64_t* sig, int pe) {
#ifdef EP_DISPATCHER_WITH_NVSHMEM
    nvshmem_putmem_signal_nbi(dst, src, bytes, sig, 1, NVSHMEM_SIGNAL_ADD, pe);
#endif
}

__device__ __forceinline__ void put_warp(void* dst, const void* src, size_t bytes, int pe) {
#ifdef EP_DISPATCHER_WITH_NVSHMEM
    nvshmemx_putmem_nbi_warp(dst, src, bytes, pe);
#endif
}

__device__ __forceinline__ void quiet() {
#ifdef EP_DISPATCHER_WITH_NVSHMEM
    nvshmem_quiet();
#endif
}

__device__ __forceinline__ uint64_t* signals(const Layout& L, const Ctx& c) {
    return reinterpret_cast<uint64_t*>(c.local + L.signal_offset);
}

// Waits until `peer` has signalled this rank `epoch` times in total; traps with a report on timeout.
__device__ void wait_signal(const Layout& L, const Ctx& c, int peer, unsigned long long epoch, int stage) {
    sync::WaitSite site{stage, c.rank, peer};
    site.node = c.node;
    sync::timed_wait(signals(L, c) + peer, [epoch](uint64_t signal) { return signal >= epoch; }, c.timeout_ns, epoch, site);
}

__device__ __forceinline__ void fail(const char* what, int rank, long long value, long long limit) {
    printf("ep_dispatcher: internode on rank %d: %s (%lld >= %lld)\n", rank, what, value, limit);
    asm volatile("trap;");
}

// ------------------------------------------------------------------ barrier and notify
__global__ void __launch_bounds__(kSyncThreads) barrier_kernel(Layout L, Ctx c, int stage) {
    __shared__ unsigned long long epoch_shared;
    if (threadIdx.x == 0) epoch_shared = c.state->epoch + 1;
    __syncthreads();
    const unsigned long long epoch = epoch_shared;
    // Earlier kernels' direct stores to node peers must be visible before a peer sees this rank's signal; puts were
    // completed (nvshmem_quiet) by the threads that issued them.
    __threadfence_system();
    for (int q = threadIdx.x; q < c.num_ranks; q += blockDim.x) signal_add(signals(L, c) + c.rank, q);
    for (int q = threadIdx.x; q < c.num_ranks; q += blockDim.x) wait_signal(L, c, q, epoch, stage);
    __syncthreads();
    if (threadIdx.x == 0) c.state->epoch = epoch;
}

__global__ void __launch_bounds__(kSyncThreads) notify_kernel(Layout L, Ctx c, const int* per_rank, const int* per_node, int num_tokens,
                                                              const int* per_expert, int num_experts, int alignment, int* count_matrix,
                                                              int* node_count, int* tokens_of, int* recv_per_expert) {
    __shared__ unsigned long long epoch_shared, parity_shared;
    if (threadIdx.x == 0) {
        epoch_shared = c.state->epoch + 1;
        parity_shared = c.state->notify_count & 1;
    }
    __syncthreads();
    const unsigned long long epoch = epoch_shared;
    const int R = c.num_ranks, N = c.num_nodes;
    const int64_t S = L.notify_slot_ints;
    const int E_l = per_expert != nullptr ? num_experts / R : 0;
    // A slot: counts per rank [R], per node [N], the sender's token count, the receiver's experts' counts [E_l].
    const int W = R + N + 1 + E_l;  // ints of one slot that this call uses
    int* stage = reinterpret_cast<int*>(c.local + L.notify_stage_offset);
    for (int i = threadIdx.x; i < R * W; i += blockDim.x) {
        const int p = i / W, k = i % W;
        stage[p * S + k] = k < R       ? per_rank[k]
                           : k < R + N ? per_node[k - R]
                           : k == R + N ? num_tokens
                                        : per_expert[p * E_l + (k - R - N - 1)];
    }
    __syncthreads();
    __threadfence_system();  // the staged counts are complete before any transport reads them
    __syncthreads();
    // Double-buffered by call parity: a peer writes slot (parity, rank) only after this rank's previous notify ended.
    int* area = reinterpret_cast<int*>(c.local + L.notify_area_offset) + parity_shared * R * S;
    for (int p = threadIdx.x; p < R; p += blockDim.x)
        put_with_signal(area + c.rank * S, stage + p * S, static_cast<size_t>(W) * sizeof(int), signals(L, c) + c.rank, p);
    for (int q = threadIdx.x; q < R; q += blockDim.x) wait_signal(L, c, q, epoch, sync::kStageInternodeNotify);
    __syncthreads();
    const volatile int* counts = area;  // written by peers' puts: read around the L1
    for (int i = threadIdx.x; i < R * R; i += blockDim.x) count_matrix[i] = counts[(i / R) * S + i % R];
    for (int i = threadIdx.x; i < R * N; i += blockDim.x) node_count[i] = counts[(i / N) * S + R + i % N];
    for (int q = threadIdx.x; q < R; q += blockDim.x) tokens_of[q] = counts[q * S + R + N];
    for (int e = threadIdx.x; e < E_l; e += blockDim.x) {
        int total = 0;
        for (int q = 0; q < R; ++q) total += counts[q * S + R + N + 1 + e];
        recv_per_expert[e] = (total + alignment - 1) / alignment * alignment;
    }
    quiet();  // the staging slots are rewritten by the next notify: the puts must have read them
    __syncthreads();
    if (threadIdx.x == 0) {
        c.state->epoch = epoch;
        c.state->notify_count += 1;
    }
}

// ------------------------------------------------------------------ dispatch
// One warp per token with at least one remote destination node: stage the message once in this rank's symmetric
// send area (puts need a registered source), then put it to the forwarder (same local index) of each remote node,
// at the row given by the token's position among this rank's tokens for that node.
__global__ void __launch_bounds__(kDataThreadsPerBlock)
    rdma_send_kernel(Layout L, Ctx c, Fields F, const uint8_t* x, const uint8_t* scales, const int64_t* topk_idx, const float* topk_weights,
                     const int* send_pos, const int* rdma_send_pos, int num_tokens) {
    const int lane = threadIdx.x % kWarpSize;
    const int N = c.num_nodes, R = c.num_ranks, T = L.max_tokens;
    bool did_put = false;
    for (int t = blockIdx.x * kDataWarpsPerBlock + threadIdx.x / kWarpSize; t < num_tokens; t += gridDim.x * kDataWarpsPerBlock) {
        bool remote = false;
        for (int n0 = 0; n0 < N; n0 += kWarpSize) {
            const int n = n0 + lane;
            const bool hit = n < N && n != c.node && rdma_send_pos[static_cast<int64_t>(t) * N + n] >= 0;
            remote |= __ballot_sync(kFullWarpMask, hit) != 0;  // every lane votes: no short-circuit around the ballot
        }
        if (!remote) continue;
        uint8_t* msg = c.local + L.send_stage_offset + static_cast<int64_t>(t) * L.msg_stride;
        warp_copy<CopySource::kPlain>(msg, x + static_cast<int64_t>(t) * F.x_bytes, F.x_bytes, lane);
        if (scales != nullptr)
            warp_copy<CopySource::kPlain>(msg + F.off_scales, scales + static_cast<int64_t>(t) * F.scale_bytes, F.scale_bytes, lane);
        if (lane < F.num_topk) {
            reinterpret_cast<int64_t*>(msg + F.off_topk)[lane] = topk_idx[static_cast<int64_t>(t) * F.num_topk + lane];
            reinterpret_cast<float*>(msg + F.off_weights)[lane] = topk_weights[static_cast<int64_t>(t) * F.num_topk + lane];
        }
        if (lane == 0) *reinterpret_cast<int*>(msg + F.off_src) = t;
        for (int i = lane; i < R; i += kWarpSize) reinterpret_cast<int*>(msg + F.off_pos)[i] = send_pos[static_cast<int64_t>(t) * R + i];
        __syncwarp();
        __threadfence_system();  // every lane's staged bytes are visible to the transport before the put reads them
        __syncwarp();
        for (int n = 0; n < N; ++n) {
            const int pos = rdma_send_pos[static_cast<int64_t>(t) * N + n];
            if (n == c.node || pos < 0) continue;
            if (pos >= T) {
                if (lane == 0) fail("dispatch: more tokens for one node than the buffer's max_tokens", c.rank, pos, T);
                __syncwarp();
            }
            uint8_t* dst = c.local + L.rdma_recv_offset + (static_cast<int64_t>(c.node) * T + pos) * L.msg_stride;
            put_warp(dst, msg, static_cast<size_t>(F.msg_bytes), n * c.per_node + c.local_rank);
            did_put = true;
        }
    }
    if (did_put) quiet();  // completes this thread's puts: the barrier after this kernel may then signal
}

// One warp per (source, token) this rank forwards: its own tokens that touch its node, then the messages received
// from each remote node's rank with the same local index. Each goes to its final row on every destination of this
// node (direct stores), and the destination set is recorded for the combine.
__global__ void __launch_bounds__(kDataThreadsPerBlock)
    forward_kernel(Layout L, Ctx c, Fields F, const uint8_t* x, const uint8_t* scales, const int64_t* topk_idx, const float* topk_weights,
                   int num_local_experts, const int* send_pos, const int* rdma_send_pos, const int* count_matrix, const int* node_count,
                   int num_tokens, int* fwd_pos, int fwd_stride, int recv_capacity, int64_t recv_x_off, int64_t recv_scales_off,
                   int64_t recv_topk_off, int64_t recv_weights_off, int64_t recv_src_off) {
    __shared__ int base[kMaxRanks];       // [n_s * P + j]: first row of source (n_s, my local index) on rank (my node, j)
    __shared__ int begin[kMaxRanks + 1];  // prefix over source nodes of the messages received (own node: 0)
    __shared__ int dst_local[kDataWarpsPerBlock][kMaxRanksPerNode];
    __shared__ int dst_row[kDataWarpsPerBlock][kMaxRanksPerNode];
    const int R = c.num_ranks, P = c.per_node, N = c.num_nodes, T = L.max_tokens;
    for (int i = threadIdx.x; i < N * P; i += blockDim.x) {
        const int s = (i / P) * P + c.local_rank, d = c.node * P + i % P;
        int b = 0;
        for (int s2 = 0; s2 < s; ++s2) b += count_matrix[s2 * R + d];
        base[i] = b;
    }
    if (threadIdx.x == 0) {
        begin[0] = 0;
        for (int n = 0; n < N; ++n) begin[n + 1] = begin[n] + (n == c.node ? 0 : node_count[(n * P + c.local_rank) * N + c.node]);
    }
    __syncthreads();
    const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
    const int64_t total = static_cast<int64_t>(num_tokens) + begin[N];
    for (int64_t v = blockIdx.x * kDataWarpsPerBlock + warp; v < total; v += gridDim.x * kDataWarpsPerBlock) {
        int n_s, j, src_token;
        const uint8_t *x_row, *scale_row;
        const int64_t* topk_row;
        const float* weight_row;
        const int* pos_row;
        if (v < num_tokens) {
            const int t = static_cast<int>(v);
            j = rdma_send_pos[static_cast<int64_t>(t) * N + c.node];
            if (j < 0) continue;  // warp-uniform
            n_s = c.node;
            src_token = t;
            x_row = x + static_cast<int64_t>(t) * F.x_bytes;
            scale_row = scales != nullptr ? scales + static_cast<int64_t>(t) * F.scale_bytes : nullptr;
            topk_row = topk_idx != nullptr ? topk_idx + static_cast<int64_t>(t) * F.num_topk : nullptr;
            weight_row = topk_weights != nullptr ? topk_weights + static_cast<int64_t>(t) * F.num_topk : nullptr;
            pos_row = send_pos + static_cast<int64_t>(t) * R;
        } else {
            const int u = static_cast<int>(v - num_tokens);
            n_s = 0;
            while (u >= begin[n_s + 1]) ++n_s;
            j = u - begin[n_s];
            const uint8_t* msg = c.local + L.rdma_recv_offset + (static_cast<int64_t>(n_s) * T + j) * L.msg_stride;
            x_row = msg;
            // Not `scales != nullptr`: a forwarder with no tokens of its own has an empty (null) scales tensor,
            // yet forwards other ranks' FP8 messages, scales included.
            scale_row = F.scale_bytes > 0 ? msg + F.off_scales : nullptr;
            topk_row = reinterpret_cast<const int64_t*>(msg + F.off_topk);
            weight_row = reinterpret_cast<const float*>(msg + F.off_weights);
            src_token = *reinterpret_cast<const int*>(msg + F.off_src);
            pos_row = reinterpret_cast<const int*>(msg + F.off_pos);
        }
        const int pos = lane < P ? pos_row[c.node * P + lane] : -1;
        const unsigned mask = __ballot_sync(kFullWarpMask, pos >= 0);
        if (fwd_pos != nullptr && lane < P) {
            if (j >= fwd_stride) fail("dispatch: a source sends more tokens than the handle's max_tokens", c.rank, j, fwd_stride);
            fwd_pos[(static_cast<int64_t>(n_s) * fwd_stride + j) * P + lane] = pos;
        }
        if (pos >= 0) {
            const int slot = __popc(mask & ((1u << lane) - 1));
            const int row = base[n_s * P + lane] + pos;
            if (row >= recv_capacity)
                fail("dispatch: receive row beyond the buffer's capacity; raise num_rdma_bytes", c.rank, row, recv_capacity);
            dst_local[warp][slot] = lane;
            dst_row[warp][slot] = row;
        }
        const int count = __popc(mask);
        __syncwarp();
        // Payload: each 16-byte vector is read once and stored to every destination.
        const int4* x_vectors = reinterpret_cast<const int4*>(x_row);
        warp_copy_batched(
            F.x_bytes / 16, lane, [&](int64_t i) { return x_vectors[i]; },
            [&](int64_t i, const int4& value) {
                for (int k = 0; k < count; ++k) {
                    uint8_t* dst =
                        c.peer[dst_local[warp][k]] + L.recv_offset + recv_x_off + static_cast<int64_t>(dst_row[warp][k]) * F.x_bytes;
                    reinterpret_cast<int4*>(dst)[i] = value;
                }
            });
        for (int k = 0; k < count; ++k) {
            const int jl = dst_local[warp][k];
            const int64_t row = dst_row[warp][k];
            uint8_t* region = c.peer[jl] + L.recv_offset;
            if (scale_row != nullptr)
                warp_copy<CopySource::kPlain>(region + recv_scales_off + row * F.scale_bytes, scale_row, F.scale_bytes, lane);
            if (topk_row != nullptr && lane < F.num_topk) {
                // Ids become the destination's local ids; experts elsewhere become -1 with weight 0.
                const int d = c.node * P + jl;
                const int64_t expert = topk_row[lane];
                const bool local = expert >= 0 && expert / num_local_experts == d;
                reinterpret_cast<int64_t*>(region + recv_topk_off)[row * F.num_topk + lane] =
                    local ? expert - static_cast<int64_t>(d) * num_local_experts : -1;
                reinterpret_cast<float*>(region + recv_weights_off)[row * F.num_topk + lane] = local ? weight_row[lane] : 0.0f;
            }
            if (lane == 0) reinterpret_cast<int*>(region + recv_src_off)[row] = src_token;
        }
        __syncwarp();
    }
    __threadfence_system();  // this thread's stores to node peers are performed before the kernel (and barrier) ends
}

// ------------------------------------------------------------------ combine
// Rows of this rank's combine area (on forwarder f) that come from node rank `d_local` for source `s`:
// forwarder f = (node, l) lays them out by destination local rank ascending, then source node ascending, then
// the order the destination received them (source token order).
__device__ __forceinline__ int forwarder_base(const int* count_matrix, int R, int P, int N, int node, int l, int d_local, int n_s) {
    int a = 0;
    for (int j = 0; j < d_local; ++j)
        for (int n = 0; n < N; ++n) a += count_matrix[(n * P + l) * R + node * P + j];
    for (int n = 0; n < n_s; ++n) a += count_matrix[(n * P + l) * R + node * P + d_local];
    return a;
}

// The top-k weights of combine row `row` of `area` (they follow the row's x bytes).
__device__ __forceinline__ const float* weights_of(const uint8_t* area, int row, const Fields& F) {
    return reinterpret_cast<const float*>(area + static_cast<int64_t>(row) * F.comb_bytes + F.x_bytes);
}

// Expert side: row i (from source s) goes to the combine area of s's forwarder on this node, (node, s % P).
__global__ void __launch_bounds__(kDataThreadsPerBlock)
    comb_nvl_send_kernel(Layout L, Ctx c, Fields F, const uint8_t* x, const float* topk_weights, const int* count_matrix) {
    __shared__ int row_begin[kMaxRanks + 1];
    __shared__ int dst_base[kMaxRanks];
    const int R = c.num_ranks, P = c.per_node, N = c.num_nodes;
    if (threadIdx.x == 0) {
        int total = 0;
        for (int s = 0; s < R; ++s) {
            row_begin[s] = total;
            total += count_matrix[s * R + c.rank];
        }
        row_begin[R] = total;
    }
    for (int s = threadIdx.x; s < R; s += blockDim.x)
        dst_base[s] = forwarder_base(count_matrix, R, P, N, c.node, s % P, c.local_rank, s / P);
    __syncthreads();
    const int capacity = R * L.max_tokens;
    const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
    for (int row = blockIdx.x * kDataWarpsPerBlock + warp; row < row_begin[R]; row += gridDim.x * kDataWarpsPerBlock) {
        int s = 0;
        while (row >= row_begin[s + 1]) ++s;
        const int64_t dst_row = dst_base[s] + (row - row_begin[s]);
        if (dst_row >= capacity) {
            if (lane == 0) fail("combine: row beyond the combine area; raise num_rdma_bytes", c.rank, dst_row, capacity);
            __syncwarp();
        }
        uint8_t* dst = c.peer[s % P] + L.comb_nvl_offset + dst_row * F.comb_bytes;
        warp_copy<CopySource::kPlain>(dst, x + static_cast<int64_t>(row) * F.x_bytes, F.x_bytes, lane);
        if (topk_weights != nullptr && lane < F.num_topk)
            reinterpret_cast<float*>(dst + F.x_bytes)[lane] = topk_weights[static_cast<int64_t>(row) * F.num_topk + lane];
    }
    __threadfence_system();  // as in forward_kernel: stores to node peers performed before the barrier
}

// Forwarder side: per (source, token) it forwarded, sum the node's rows in fp32 by destination local rank
// ascending, round to the output type, and send the partial to the source (a put for remote nodes; its own
// tokens' partials stay in its own area).
template <typename T>
__global__ void __launch_bounds__(kDataThreadsPerBlock)
    comb_forward_kernel(Layout L, Ctx c, Fields F, const int* count_matrix, const int* node_count, const int* fwd_pos, int fwd_stride) {
    __shared__ int fbase[kMaxRanks];      // [n_s * P + j]: forwarder_base(j, n_s) for this rank
    __shared__ int begin[kMaxRanks + 1];  // prefix over source nodes of the tokens this rank forwarded
    __shared__ int rows[kDataWarpsPerBlock][kMaxRanksPerNode];
    const int R = c.num_ranks, P = c.per_node, N = c.num_nodes, Tm = L.max_tokens;
    for (int i = threadIdx.x; i < N * P; i += blockDim.x)
        fbase[i] = forwarder_base(count_matrix, R, P, N, c.node, c.local_rank, i % P, i / P);
    if (threadIdx.x == 0) {
        begin[0] = 0;
        for (int n = 0; n < N; ++n) begin[n + 1] = begin[n] + node_count[(n * P + c.local_rank) * N + c.node];
    }
    __syncthreads();
    const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
    const uint8_t* area = c.local + L.comb_nvl_offset;
    bool did_put = false;
    for (int v = blockIdx.x * kDataWarpsPerBlock + warp; v < begin[N]; v += gridDim.x * kDataWarpsPerBlock) {
        int n_s = 0;
        while (v >= begin[n_s + 1]) ++n_s;
        const int j = v - begin[n_s];
        if (j >= Tm || j >= fwd_stride) {
            if (lane == 0) fail("combine: a source has more tokens than the buffer's max_tokens", c.rank, j, min(Tm, fwd_stride));
            __syncwarp();
        }
        const int pos = lane < P ? fwd_pos[(static_cast<int64_t>(n_s) * fwd_stride + j) * P + lane] : -1;
        const unsigned mask = __ballot_sync(kFullWarpMask, pos >= 0);
        if (pos >= 0) rows[warp][__popc(mask & ((1u << lane) - 1))] = fbase[n_s * P + lane] + pos;
        const int count = __popc(mask);
        __syncwarp();
        uint8_t* out = n_s == c.node ? c.local + L.comb_rdma_offset + (static_cast<int64_t>(c.node) * Tm + j) * F.comb_bytes
                                     : c.local + L.comb_stage_offset + (static_cast<int64_t>(n_s) * Tm + j) * F.comb_bytes;
        // The node's rows by destination local rank ascending (no bias: the source adds it once).
        const auto node_row = [&](int r) {
            return reinterpret_cast<const int4*>(area + static_cast<int64_t>(rows[warp][r]) * F.comb_bytes);
        };
        sum_token_rows<T>(nullptr, nullptr, count, node_row, reinterpret_cast<T*>(out), F.x_bytes / 16, lane);
        if (lane < F.num_topk)
            reinterpret_cast<float*>(out + F.x_bytes)[lane] =
                sum_token_weights(count, [&](int r) { return weights_of(area, rows[warp][r], F); }, lane);
        __syncwarp();
        if (n_s != c.node) {
            __threadfence_system();  // the staged partial is complete before the transport reads it
            __syncwarp();
            uint8_t* dst = c.local + L.comb_rdma_offset + (static_cast<int64_t>(c.node) * Tm + j) * F.comb_bytes;
            put_warp(dst, out, static_cast<size_t>(F.comb_bytes), n_s * P + c.local_rank);
            did_put = true;
        }
    }
    if (did_put) quiet();
}

// Source side: out[t] = bias0 + bias1 + node partials by node ascending, in fp32, rounded once.
template <typename T>
__global__ void __launch_bounds__(kDataThreadsPerBlock)
    comb_reduce_kernel(Layout L, Ctx c, Fields F, const T* bias0, const T* bias1, const int* rdma_send_pos, int num_tokens, T* out,
                       float* out_weights) {
    using V = Vec<T>;
    __shared__ int rows[kDataWarpsPerBlock][kMaxRanks];
    const int N = c.num_nodes, Tm = L.max_tokens;
    const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
    const uint8_t* area = c.local + L.comb_rdma_offset;
    const int vectors = F.x_bytes / 16;
    const int hidden = vectors * V::kElems;
    for (int t = blockIdx.x * kDataWarpsPerBlock + warp; t < num_tokens; t += gridDim.x * kDataWarpsPerBlock) {
        int count = 0;
        for (int n0 = 0; n0 < N; n0 += kWarpSize) {
            const int n = n0 + lane;
            const int pos = n < N ? rdma_send_pos[static_cast<int64_t>(t) * N + n] : -1;
            const unsigned mask = __ballot_sync(kFullWarpMask, pos >= 0);
            if (pos >= 0) rows[warp][count + __popc(mask & ((1u << lane) - 1))] = n * Tm + pos;
            count += __popc(mask);
        }
        __syncwarp();
        // Bias first, then the node partials by node ascending: the reference backend's order.
        const int64_t first = static_cast<int64_t>(t) * hidden;
        const auto node_partial = [&](int r) {
            return reinterpret_cast<const int4*>(area + static_cast<int64_t>(rows[warp][r]) * F.comb_bytes);
        };
        sum_token_rows(bias0 != nullptr ? bias0 + first : nullptr, bias1 != nullptr ? bias1 + first : nullptr, count, node_partial,
                       out + first, vectors, lane);
        if (out_weights != nullptr && lane < F.num_topk)
            out_weights[static_cast<int64_t>(t) * F.num_topk + lane] =
                sum_token_weights(count, [&](int r) { return weights_of(area, rows[warp][r], F); }, lane);
        __syncwarp();
    }
}

}  // namespace

Layout make_layout(int64_t hidden_bytes, int num_ranks, int num_ranks_per_node, int max_tokens) {
    EP_HOST_ASSERT(hidden_bytes > 0 && hidden_bytes % 16 == 0, "hidden_bytes must be a positive multiple of 16, got ", hidden_bytes);
    EP_HOST_ASSERT(num_ranks_per_node > 0 && num_ranks % num_ranks_per_node == 0, "num_ranks=", num_ranks,
                   " must be a multiple of num_ranks_per_node=", num_ranks_per_node);
    EP_HOST_ASSERT(max_tokens >= 0, "max_tokens=", max_tokens);
    Layout L{};
    const int64_t R = num_ranks, P = num_ranks_per_node, N = R / P, T = max_tokens;
    L.num_ranks = num_ranks;
    L.num_ranks_per_node = num_ranks_per_node;
    L.num_nodes = static_cast<int>(N);
    L.max_tokens = max_tokens;
    L.hidden_bytes = hidden_bytes;
    L.notify_slot_ints = R + N + 1 + kMaxLocalExperts;
    // Worst-case fields: FP8 scales of a BF16-sized row, top-k of kMaxTopk, 8 bytes of alignment padding before the
    // int64 ids, the source index and the R destination positions.
    const int64_t scale_max = ceil_div<int64_t>(hidden_bytes / 2, kFp8GroupSize) * 4;
    L.msg_stride = align_up(hidden_bytes + scale_max + 8 + kMaxTopk * 12 + 4 + R * 4, 16);
    L.recv_row_max = hidden_bytes + scale_max + kMaxTopk * 12 + 4;
    L.comb_stride_max = align_up(hidden_bytes + kMaxTopk * 4, 16);
    L.signal_offset = 0;
    L.notify_area_offset = align_up(R * 8, kRegionAlignment);
    L.notify_stage_offset = L.notify_area_offset + align_up(2 * R * L.notify_slot_ints * 4, kRegionAlignment);
    L.data_offset = L.notify_stage_offset + align_up(R * L.notify_slot_ints * 4, kRegionAlignment);
    // Dispatch: staged messages [T], received messages [N source nodes][T], final receive rows (R * T at most).
    L.send_stage_offset = L.data_offset;
    L.rdma_recv_offset = L.send_stage_offset + align_up(T * L.msg_stride, kRegionAlignment);
    L.recv_offset = L.rdma_recv_offset + align_up(N * T * L.msg_stride, kRegionAlignment);
    L.recv_bytes = align_up(R * T * L.recv_row_max + 5 * kRegionAlignment, kRegionAlignment);  // 5 regions, each 128-byte aligned
    const int64_t dispatch_end = L.recv_offset + L.recv_bytes;
    // Combine (reuses the dispatch's bytes): node rows at the forwarder [R * T], partials at the source [N][T],
    // staged partials at the forwarder [N][T].
    L.comb_nvl_offset = L.data_offset;
    L.comb_rdma_offset = L.comb_nvl_offset + align_up(R * T * L.comb_stride_max, kRegionAlignment);
    L.comb_stage_offset = L.comb_rdma_offset + align_up(N * T * L.comb_stride_max, kRegionAlignment);
    const int64_t combine_end = L.comb_stage_offset + align_up(N * T * L.comb_stride_max, kRegionAlignment);
    L.total_bytes = std::max(dispatch_end, combine_end);
    return L;
}

int max_tokens_for(int64_t num_bytes, int64_t hidden_bytes, int num_ranks, int num_ranks_per_node) {
    const Layout zero = make_layout(hidden_bytes, num_ranks, num_ranks_per_node, 0);
    if (num_bytes < zero.total_bytes) return 0;
    const Layout one = make_layout(hidden_bytes, num_ranks, num_ranks_per_node, 1);
    const int64_t per_token = std::max<int64_t>(1, one.total_bytes - zero.total_bytes);
    int64_t t = std::min<int64_t>(INT32_MAX / std::max(1, num_ranks), (num_bytes - zero.total_bytes) / per_token + 1);
    // Alignment makes the size only nearly linear in t: settle the estimate in both directions.
    while (t > 0 && make_layout(hidden_bytes, num_ranks, num_ranks_per_node, static_cast<int>(t)).total_bytes > num_bytes) --t;
    while (t < INT32_MAX / std::max(1, num_ranks) &&
           make_layout(hidden_bytes, num_ranks, num_ranks_per_node, static_cast<int>(t + 1)).total_bytes <= num_bytes)
        ++t;
    return static_cast<int>(t);
}

Fields make_fields(const Layout& L, int x_bytes, int scale_bytes, int num_topk) {
    EP_HOST_ASSERT(x_bytes > 0 && x_bytes % 16 == 0 && x_bytes <= L.hidden_bytes, "x row bytes ", x_bytes, " (layout for ", L.hidden_bytes,
                   ")");
    EP_HOST_ASSERT(scale_bytes % 4 == 0, "scale row bytes ", scale_bytes);
    EP_HOST_ASSERT(num_topk >= 0 && num_topk <= kMaxTopk, "num_topk=", num_topk, " exceeds ", kMaxTopk);
    Fields F{};
    F.x_bytes = x_bytes;
    F.scale_bytes = scale_bytes;
    F.num_topk = num_topk;
    F.off_scales = x_bytes;
    F.off_topk = align_up(F.off_scales + scale_bytes, 8);
    F.off_weights = F.off_topk + int64_t(num_topk) * 8;
    F.off_src = F.off_weights + int64_t(num_topk) * 4;
    F.off_pos = F.off_src + 4;
    F.msg_bytes = align_up(F.off_pos + int64_t(L.num_ranks) * 4, 16);
    F.comb_bytes = align_up(int64_t(x_bytes) + int64_t(num_topk) * 4, 16);
    EP_HOST_ASSERT(F.msg_bytes <= L.msg_stride && F.comb_bytes <= L.comb_stride_max, "message of ", F.msg_bytes,
                   " bytes exceeds the layout's ", L.msg_stride, " (scales wider than hidden / 128?)");
    return F;
}

void barrier(const Layout& L, const Ctx& c, int stage, cudaStream_t stream) {
    barrier_kernel<<<1, kSyncThreads, 0, stream>>>(L, c, stage);
    EP_CUDA_CHECK(cudaGetLastError());
}

void notify(const Layout& L, const Ctx& c, const int* num_tokens_per_rank, const int* num_tokens_per_node, int num_tokens,
            const int* num_tokens_per_expert, int num_experts, int expert_alignment, int* count_matrix, int* node_count, int* tokens_of,
            int* recv_per_expert, cudaStream_t stream) {
    EP_HOST_ASSERT(num_tokens_per_expert == nullptr || num_experts / c.num_ranks <= kMaxLocalExperts, "num_experts=", num_experts,
                   ": internode kernels support up to ", kMaxLocalExperts, " experts per rank");
    notify_kernel<<<1, kSyncThreads, 0, stream>>>(L, c, num_tokens_per_rank, num_tokens_per_node, num_tokens, num_tokens_per_expert,
                                                  num_experts, expert_alignment, count_matrix, node_count, tokens_of, recv_per_expert);
    EP_CUDA_CHECK(cudaGetLastError());
}

void dispatch(const Layout& L, const Ctx& c, const Fields& F, const void* x, const void* scales, const int64_t* topk_idx,
              const float* topk_weights, int num_local_experts, const int* send_pos, const int* rdma_send_pos, const int* count_matrix,
              const int* node_count, int num_tokens, int* fwd_pos, int fwd_stride, int recv_capacity, int64_t recv_x_offset,
              int64_t recv_scales_offset, int64_t recv_topk_offset, int64_t recv_weights_offset, int64_t recv_src_offset, int num_sms,
              cudaStream_t stream) {
    EP_HOST_ASSERT(num_tokens <= L.max_tokens, "num_tokens=", num_tokens, " exceeds the layout's max_tokens=", L.max_tokens);
    const auto* xb = static_cast<const uint8_t*>(x);
    const auto* sb = static_cast<const uint8_t*>(scales);
    if (num_tokens > 0) {
        rdma_send_kernel<<<data_grid(num_sms, num_tokens), kDataThreadsPerBlock, 0, stream>>>(L, c, F, xb, sb, topk_idx, topk_weights,
                                                                                              send_pos, rdma_send_pos, num_tokens);
        EP_CUDA_CHECK(cudaGetLastError());
    }
    barrier(L, c, sync::kStageInternodeDispatchSent, stream);
    // The received message count is only known on the device: num_sms blocks loop over it.
    forward_kernel<<<std::max(1, num_sms), kDataThreadsPerBlock, 0, stream>>>(
        L, c, F, xb, sb, topk_idx, topk_weights, num_local_experts, send_pos, rdma_send_pos, count_matrix, node_count, num_tokens, fwd_pos,
        fwd_stride, recv_capacity, recv_x_offset, recv_scales_offset, recv_topk_offset, recv_weights_offset, recv_src_offset);
    EP_CUDA_CHECK(cudaGetLastError());
    barrier(L, c, sync::kStageInternodeDispatchForwarded, stream);
}

void cached_dispatch_start(const Layout& L, const Ctx& c, cudaStream_t stream) {
    barrier(L, c, sync::kStageInternodeDispatchStart, stream);
}

void combine(const Layout& L, const Ctx& c, const Fields& F, FloatType type, const void* x, const float* topk_weights, const void* bias0,
             const void* bias1, const int* rdma_send_pos, const int* count_matrix, const int* node_count, const int* fwd_pos,
             int fwd_stride, int num_tokens, void* out, float* out_weights, int num_sms, cudaStream_t stream) {
    EP_HOST_ASSERT(num_tokens <= L.max_tokens, "num_tokens=", num_tokens, " exceeds the layout's max_tokens=", L.max_tokens);
    const int grid = std::max(1, num_sms);
    barrier(L, c, sync::kStageInternodeCombineStart, stream);  // every rank is done with the buffer's previous use
    comb_nvl_send_kernel<<<grid, kDataThreadsPerBlock, 0, stream>>>(L, c, F, static_cast<const uint8_t*>(x), topk_weights, count_matrix);
    EP_CUDA_CHECK(cudaGetLastError());
    barrier(L, c, sync::kStageInternodeCombineNvl, stream);
    with_float_type(type, [&](auto element) {
        using T = decltype(element);
        comb_forward_kernel<T><<<grid, kDataThreadsPerBlock, 0, stream>>>(L, c, F, count_matrix, node_count, fwd_pos, fwd_stride);
    });
    EP_CUDA_CHECK(cudaGetLastError());
    barrier(L, c, sync::kStageInternodeCombineRdma, stream);
    if (num_tokens == 0) return;
    with_float_type(type, [&](auto element) {
        using T = decltype(element);
        comb_reduce_kernel<T><<<data_grid(num_sms, num_tokens), kDataThreadsPerBlock, 0, stream>>>(
            L, c, F, static_cast<const T*>(bias0), static_cast<const T*>(bias1), rdma_send_pos, num_tokens, static_cast<T*>(out),
            out_weights);
    });
    EP_CUDA_CHECK(cudaGetLastError());
}

}  // namespace ep::internode
