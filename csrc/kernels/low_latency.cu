// Low-latency kernels: see low_latency.cuh for the buffer layout and the protocol.

#include "kernels/nvshmem_device.cuh"  // first: it re-enables the half/bf16 operators NVSHMEM needs

#include "kernels/low_latency.cuh"

#include <cuda_fp8.h>

#include <algorithm>

#include "kernels/common.cuh"
#include "kernels/copy.cuh"
#include "kernels/sync.cuh"

namespace ep::low_latency {
namespace {

constexpr int kWarpSize = 32;
constexpr int kThreads = 512;  // 16 warps: the receive kernels (a block per local expert, a warp per message) and the sum
constexpr int kWarps = kThreads / kWarpSize;
// The warp-per-item kernels (cast, send, combine send) run in small blocks: the same threads over 4x the SMs, so a
// few hundred warps spread over the GPU instead of piling onto max_blocks SMs. Their grids stay within the thread
// budget of max_blocks full blocks, so all ranks' kernels on one GPU remain co-resident.
constexpr int kSmallThreads = 128;
constexpr int kSmallWarps = kSmallThreads / kWarpSize;
constexpr int kSmallPerFull = kThreads / kSmallThreads;
constexpr unsigned kFullMask = 0xffffffffu;

// ------------------------------------------------------------------ signals
__device__ __forceinline__ int4 load_nc(const int4* ptr) {
    int4 v;
    asm volatile("ld.global.nc.v4.s32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(ptr));
    return v;
}

// Writes `value` into `signal` (a symmetric address in this half) on PE `pe`, after this warp's earlier writes to
// that PE: a release store through the peer mapping, or an NVSHMEM fence + signal. Called by one lane.
__device__ __forceinline__ void signal_peer(const Half& h, uint64_t* signal, uint64_t value, int pe) {
    const int64_t peer = h.peer_base[pe];
    if (peer != 0) {
        __threadfence_system();
        sync::store_release_sys(reinterpret_cast<uint64_t*>(peer + h.half_offset + (reinterpret_cast<uint8_t*>(signal) - h.local)), value);
        return;
    }
#ifdef EP_DISPATCHER_WITH_NVSHMEM
    nvshmem_fence();
    nvshmemx_signal_op(signal, value, NVSHMEM_SIGNAL_SET, pe);
#endif
}

// Copies `bytes` (a multiple of 16) from this rank's `src` to `dst` (a symmetric address in this half) on PE
// `pe`, by the whole warp: stores through the peer mapping, or a non-blocking NVSHMEM put (src must then be
// symmetric too; it is always staged in the half's send area).
__device__ __forceinline__ void warp_copy_to_peer(const Half& h, uint8_t* dst, const uint8_t* src, int64_t bytes, int pe, int lane) {
    const int64_t peer = h.peer_base[pe];
    if (peer != 0) {
        int4* out = reinterpret_cast<int4*>(peer + h.half_offset + (dst - h.local));
        const int4* in = reinterpret_cast<const int4*>(src);
        warp_copy_batched(bytes / 16, lane, [&](int64_t i) { return load_nc(in + i); }, [&](int64_t i, const int4& v) { out[i] = v; });
        return;
    }
#ifdef EP_DISPATCHER_WITH_NVSHMEM
    nvshmemx_putmem_nbi_warp(dst, src, static_cast<size_t>(bytes), pe);
#endif
}

// NVSHMEM puts are non-blocking: complete them before the staged source can be rewritten by a later call.
__device__ __forceinline__ void quiet_puts(const Half& h, int pe) {
#ifdef EP_DISPATCHER_WITH_NVSHMEM
    if (h.peer_base[pe] == 0) nvshmem_quiet();
#endif
}

// Called by the whole warp before its lane 0 signals `pe`: every lane's data reaches `pe` first. Direct stores
// need a system fence per lane; NVSHMEM puts are completed by each issuing lane (fence ordering is per thread).
__device__ __forceinline__ void complete_warp_writes(const Half& h, int pe) {
    __threadfence_system();
#ifdef EP_DISPATCHER_WITH_NVSHMEM
    if (h.peer_base[pe] == 0) nvshmem_quiet();
#endif
    __syncwarp();
}

__device__ __forceinline__ uint64_t make_signal(unsigned long long epoch, uint32_t low) {
    return (static_cast<uint64_t>(epoch) << 32) | low;
}

// Spins until `signal`'s epoch (upper 32 bits) equals `epoch`; returns the value. Times out with a report.
__device__ __forceinline__ uint64_t wait_signal(const uint64_t* signal, unsigned long long epoch, const Half& h, const char* stage,
                                                int peer, int expert) {
    const uint64_t start = sync::global_timer_ns();
    const uint32_t want = static_cast<uint32_t>(epoch);
    while (true) {
        const uint64_t v = sync::load_acquire_sys(signal);
        // Exact match: a stale value from an older epoch, or bytes left by a call of another shape, never passes.
        if (static_cast<uint32_t>(v >> 32) == want) return v;
        if (sync::global_timer_ns() - start > static_cast<uint64_t>(h.timeout_ns)) {
            printf("ep_dispatcher: timeout after %lld ms on rank %d, low-latency %s (buffer half %d, epoch %u): waiting for rank %d, "
                   "expert %d\n",
                   static_cast<long long>(h.timeout_ns / 1000000), h.rank, stage, h.half, want, peer, expert);
            asm volatile("trap;");
        }
    }
}

__device__ __forceinline__ uint64_t* dispatch_signals(const Layout& L, const Half& h) {
    return reinterpret_cast<uint64_t*>(h.local + L.dispatch_signal_offset());
}
__device__ __forceinline__ uint64_t* combine_signals(const Layout& L, const Half& h) {
    return reinterpret_cast<uint64_t*>(h.local + L.combine_signal_offset());
}
__device__ __forceinline__ uint64_t* acks(const Layout& L, const Half& h) { return reinterpret_cast<uint64_t*>(h.local + L.ack_offset()); }

// Before a sender writes into `pe`'s half again, `pe` must have read the half's previous use (epoch - 1).
__device__ __forceinline__ void wait_ack(const Layout& L, const Half& h, unsigned long long next_epoch, int pe, const char* stage) {
    if (next_epoch > 1) wait_signal(acks(L, h) + pe, next_epoch - 1, h, stage, pe, -1);
}

// Run by every block at the end of a receive kernel: the last block to finish advances the half's epoch and
// tells every sender that this rank has read the half.
__device__ void finish_receive(const Layout& L, const Half& h, unsigned long long epoch) {
    __shared__ bool is_last;
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        is_last = atomicAdd(&h.state->arrived[h.half], 1u) == gridDim.x - 1;
    }
    __syncthreads();
    if (!is_last) return;
    if (threadIdx.x == 0) {
        h.state->arrived[h.half] = 0;
        h.state->epoch[h.half] = epoch;
    }
    for (int pe = threadIdx.x; pe < L.num_ranks; pe += blockDim.x) {
        signal_peer(h, acks(L, h) + h.rank, make_signal(epoch, 0), pe);
        quiet_puts(h, pe);
    }
}

// ------------------------------------------------------------------ FP8 cast (bit-exact with ep_dispatcher.fp8)
__device__ __forceinline__ float round_up_pow2(float scale) {
    const uint32_t bits = __float_as_uint(scale);
    if ((bits & 0x7fffffu) == 0) return scale;  // already a power of two
    return __uint_as_float((bits & 0xff800000u) + 0x800000u);
}

// One warp casts (or copies) one token into its staged message: header, payload, then fp32 scales.
template <bool kUseFP8>
__device__ void stage_token(const Layout& L, const __nv_bfloat16* row, uint8_t* msg, int token, bool round_scale, int lane) {
    if (lane == 0) *reinterpret_cast<int4*>(msg) = make_int4(token, 0, 0, 0);
    uint8_t* payload = msg + kHeaderBytes;
    const int H = L.hidden;
    if constexpr (!kUseFP8) {
        const int4* in = reinterpret_cast<const int4*>(row);
        int4* out = reinterpret_cast<int4*>(payload);
        warp_copy_batched(H / 8, lane, [&](int64_t i) { return load_nc(in + i); }, [&](int64_t i, const int4& v) { out[i] = v; });
    } else {
        float* scales = reinterpret_cast<float*>(payload + H);
        // A half-warp covers one 128-channel group, 8 channels per lane: 256 channels per warp step; the loads of
        // kCastBatch steps are issued before any is used (one memory latency per batch, not per step).
        constexpr int kCastBatch = 4;
        for (int batch = 0; batch < H; batch += kCastBatch * 2 * kFp8GroupSize) {
            int4 raw[kCastBatch];
#pragma unroll
            for (int u = 0; u < kCastBatch; ++u) {
                const int channel = batch + u * 2 * kFp8GroupSize + lane * 8;
                if (channel < H) raw[u] = load_nc(reinterpret_cast<const int4*>(row + channel));
            }
#pragma unroll
            for (int u = 0; u < kCastBatch; ++u) {
                const int channel = batch + u * 2 * kFp8GroupSize + lane * 8;
                const bool active = channel < H;
                float v[8];
                float amax = 0.f;
                if (active) {
                    const __nv_bfloat162* pairs = reinterpret_cast<const __nv_bfloat162*>(&raw[u]);
#pragma unroll
                    for (int j = 0; j < 4; ++j) {
                        const float2 f = __bfloat1622float2(pairs[j]);
                        v[2 * j] = f.x;
                        v[2 * j + 1] = f.y;
                    }
#pragma unroll
                    for (int j = 0; j < 8; ++j) amax = fmaxf(amax, fabsf(v[j]));
                }
#pragma unroll
                for (int offset = 8; offset > 0; offset >>= 1) amax = fmaxf(amax, __shfl_xor_sync(kFullMask, amax, offset));
                if (!active) continue;
                float scale = __fdiv_rn(fmaxf(amax, 1e-4f), 448.0f);
                if (round_scale) scale = round_up_pow2(scale);
                uint32_t packed[2];
#pragma unroll
                for (int j = 0; j < 2; ++j) {
                    const __nv_fp8x2_storage_t lo = __nv_cvt_float2_to_fp8x2(
                        make_float2(__fdiv_rn(v[4 * j], scale), __fdiv_rn(v[4 * j + 1], scale)), __NV_SATFINITE, __NV_E4M3);
                    const __nv_fp8x2_storage_t hi = __nv_cvt_float2_to_fp8x2(
                        make_float2(__fdiv_rn(v[4 * j + 2], scale), __fdiv_rn(v[4 * j + 3], scale)), __NV_SATFINITE, __NV_E4M3);
                    packed[j] = static_cast<uint32_t>(lo) | (static_cast<uint32_t>(hi) << 16);
                }
                *reinterpret_cast<uint2*>(payload + channel) = make_uint2(packed[0], packed[1]);
                if ((lane & 15) == 0) scales[channel / kFp8GroupSize] = scale;
            }
        }
    }
}

// ------------------------------------------------------------------ dispatch
template <bool kUseFP8>
__global__ void __launch_bounds__(kSmallThreads) stage_tokens_kernel(Layout L, Half h, const __nv_bfloat16* x, int num_tokens, bool round_scale) {
    const int lane = threadIdx.x % kWarpSize;
    const int warp = blockIdx.x * kSmallWarps + threadIdx.x / kWarpSize;
    for (int t = warp; t < num_tokens; t += gridDim.x * kSmallWarps)
        stage_token<kUseFP8>(L, x + static_cast<int64_t>(t) * L.hidden, h.local + L.send_offset() + t * L.dispatch_msg_bytes, t,
                             round_scale, lane);
}

// One warp per global expert: finds this rank's entries for it in token order (ballots over topk_idx), records
// each entry's slot for the combine, copies the staged messages to the expert's rank, then signals the count.
__device__ void send_expert_tokens(const Layout& L, const Half& h, const int64_t* topk_idx, int num_tokens, int num_topk, int* send_slot,
                                   int expert, int lane) {
    const int pe = expert / L.num_local_experts, local_expert = expert % L.num_local_experts;
    const unsigned long long epoch = h.state->epoch[h.half] + 1;
    if (lane == 0) wait_ack(L, h, epoch, pe, "dispatch send (peer has not read this half's previous use)");
    __syncwarp();

    uint8_t* region = h.local + L.recv_offset() + (static_cast<int64_t>(local_expert) * L.num_ranks + h.rank) * L.max_tokens * L.dispatch_msg_bytes;
    const uint8_t* staged = h.local + L.send_offset();
    const int num_entries = num_tokens * num_topk;
    int count = 0;
    constexpr int kScanBatch = 4;  // topk_idx loads in flight per lane (the scan is latency-bound, not bandwidth-bound)
    for (int batch = 0; batch < num_entries; batch += kScanBatch * kWarpSize) {
        int64_t ids[kScanBatch];
#pragma unroll
        for (int u = 0; u < kScanBatch; ++u) {
            const int entry = batch + u * kWarpSize + lane;
            ids[u] = entry < num_entries ? __ldg(topk_idx + entry) : -1;
        }
#pragma unroll
        for (int u = 0; u < kScanBatch; ++u) {
            const int base = batch + u * kWarpSize;
            const bool match = ids[u] == expert;
            unsigned ballot = __ballot_sync(kFullMask, match);
            if (match) send_slot[base + lane] = count + __popc(ballot & ((1u << lane) - 1));
            while (ballot != 0) {
                const int token = (base + __ffs(ballot) - 1) / num_topk;
                ballot &= ballot - 1;
                if (count >= L.max_tokens) {  // only possible when a token lists the same expert twice
                    if (lane == 0)
                        printf("ep_dispatcher: rank %d, low-latency dispatch: more than num_max_dispatch_tokens_per_rank = %d entries "
                               "for expert %d (topk_idx repeats an expert within a token)\n",
                               h.rank, L.max_tokens, expert);
                    asm volatile("trap;");
                }
                warp_copy_to_peer(h, region + static_cast<int64_t>(count) * L.dispatch_msg_bytes, staged + token * L.dispatch_msg_bytes,
                                  L.dispatch_msg_bytes, pe, lane);
                ++count;
            }
        }
    }
    complete_warp_writes(h, pe);
    if (lane == 0) {
        signal_peer(h, dispatch_signals(L, h) + local_expert * L.num_ranks + h.rank, make_signal(epoch, count), pe);
        quiet_puts(h, pe);
    }
}

// Warps loop over experts: the grid may be smaller than one warp per expert (max_blocks, see low_latency.cuh).
__global__ void __launch_bounds__(kSmallThreads) send_tokens_kernel(Layout L, Half h, const int64_t* topk_idx, int num_tokens, int num_topk,
                                                               int* send_slot) {
    const int lane = threadIdx.x % kWarpSize;
    for (int expert = blockIdx.x * kSmallWarps + threadIdx.x / kWarpSize; expert < L.num_experts; expert += gridDim.x * kSmallWarps)
        send_expert_tokens(L, h, topk_idx, num_tokens, num_topk, send_slot, expert, lane);
}

// One block per local expert (blocks loop when there are more experts than blocks): waits for every source rank's
// count, packs the sources in rank order into the expert-major output and writes the handle (source token of each
// slot, per-source ranges) and the counts.
template <bool kUseFP8, bool kUE8M0>
__global__ void __launch_bounds__(kThreads) receive_tokens_kernel(Layout L, Half h, void* recv_x, void* recv_scales, int* src_info,
                                                                  int64_t* layout_range, int* recv_count, int* cumulative_stats) {
    extern __shared__ int begin[];  // [R + 1] exclusive prefix of the per-source counts
    __shared__ unsigned long long epoch_shared;
    const int R = L.num_ranks, T = L.max_tokens, H = L.hidden;
    const int num_slots = R * T;
    if (threadIdx.x == 0) epoch_shared = h.state->epoch[h.half] + 1;
    __syncthreads();
    const unsigned long long epoch = epoch_shared;
    for (int local_expert = blockIdx.x; local_expert < L.num_local_experts; local_expert += gridDim.x) {
        for (int r = threadIdx.x; r < R; r += blockDim.x) {
            const uint64_t v =
                wait_signal(dispatch_signals(L, h) + local_expert * R + r, epoch, h, "dispatch receive", r, local_expert + h.rank * L.num_local_experts);
            begin[r + 1] = static_cast<int>(v & 0xffffffffu);
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            begin[0] = 0;
            for (int r = 0; r < R; ++r) begin[r + 1] += begin[r];
            recv_count[local_expert] = begin[R];
            if (cumulative_stats != nullptr) cumulative_stats[local_expert] += begin[R];
        }
        __syncthreads();
        const int total = begin[R];
        for (int r = threadIdx.x; r < R; r += blockDim.x)
            layout_range[local_expert * R + r] = (static_cast<int64_t>(begin[r]) << 32) | static_cast<int64_t>(begin[r + 1] - begin[r]);
        for (int s = total + threadIdx.x; s < num_slots; s += blockDim.x) src_info[local_expert * num_slots + s] = -1;

        const int lane = threadIdx.x % kWarpSize;
        const int groups = H / kFp8GroupSize;
        const int64_t row_bytes = kUseFP8 ? H : 2 * H;
        for (int slot = threadIdx.x / kWarpSize; slot < total; slot += kWarps) {
            int r = 0;  // source rank of this slot: the last r with begin[r] <= slot
            for (int lo = 0, hi = R - 1; lo <= hi;) {
                const int mid = (lo + hi) / 2;
                if (begin[mid] <= slot) r = mid, lo = mid + 1;
                else hi = mid - 1;
            }
            const uint8_t* msg =
                h.local + L.recv_offset() + ((static_cast<int64_t>(local_expert) * R + r) * T + (slot - begin[r])) * L.dispatch_msg_bytes;
            const int64_t out_row = static_cast<int64_t>(local_expert) * num_slots + slot;
            // Received bytes are read with ld.global.cg (L2, not L1): peers wrote them during this kernel.
            const int4* in = reinterpret_cast<const int4*>(msg + kHeaderBytes);
            int4* out = reinterpret_cast<int4*>(static_cast<uint8_t*>(recv_x) + out_row * row_bytes);
            warp_copy_batched(row_bytes / 16, lane, [&](int64_t i) { return __ldcg(in + i); }, [&](int64_t i, const int4& v) { out[i] = v; });
            if (lane == 0) src_info[out_row] = __ldcg(reinterpret_cast<const int*>(msg));
            if constexpr (kUseFP8) {
                const float* scales = reinterpret_cast<const float*>(msg + kHeaderBytes + H);
                // Scales are stored group-major ([E_local, groups, num_slots]) and returned as a transposed view.
                if constexpr (kUE8M0) {
                    for (int word = lane; word < groups / 4; word += kWarpSize) {
                        uint32_t packed = 0;
#pragma unroll
                        for (int b = 0; b < 4; ++b) packed |= ((__float_as_uint(__ldcg(scales + 4 * word + b)) >> 23) & 0xffu) << (8 * b);
                        static_cast<uint32_t*>(recv_scales)[(static_cast<int64_t>(local_expert) * (groups / 4) + word) * num_slots + slot] = packed;
                    }
                } else {
                    for (int g = lane; g < groups; g += kWarpSize)
                        static_cast<float*>(recv_scales)[(static_cast<int64_t>(local_expert) * groups + g) * num_slots + slot] = __ldcg(scales + g);
                }
            }
        }
        __syncthreads();  // `begin` is rewritten for the next expert
    }
    finish_receive(L, h, epoch);
}

// ------------------------------------------------------------------ combine
// One warp per (local expert, source rank): sends that source's slots back, row i of the range landing at
// [global expert][i] on the source (the slot the source chose in dispatch), then flags the expert as done.
__device__ void send_pair_outputs(const Layout& L, const Half& h, const __nv_bfloat16* x, bool x_is_staged, const int64_t* layout_range,
                                  int pair, int lane) {
    const int local_expert = pair / L.num_ranks, pe = pair % L.num_ranks;
    const int expert = h.rank * L.num_local_experts + local_expert;
    const unsigned long long epoch = h.state->epoch[h.half] + 1;
    if (lane == 0) wait_ack(L, h, epoch, pe, "combine send (peer has not read this half's previous use)");
    __syncwarp();
    const int64_t range = layout_range[pair];
    const int begin = static_cast<int>(range >> 32), count = static_cast<int>(range & 0xffffffff);
    const int64_t row_bytes = 2 * static_cast<int64_t>(L.hidden);
    const int64_t num_slots = static_cast<int64_t>(L.num_ranks) * L.max_tokens;
    uint8_t* staged_base = h.local + L.send_offset();
    uint8_t* dst_base = h.local + L.recv_offset() + static_cast<int64_t>(expert) * L.max_tokens * row_bytes;
    const bool direct = h.peer_base[pe] != 0;
    for (int i = 0; i < count; ++i) {
        const int64_t row = local_expert * num_slots + begin + i;
        const uint8_t* src = reinterpret_cast<const uint8_t*>(x) + row * row_bytes;
        if (!direct && !x_is_staged) {  // NVSHMEM puts read symmetric memory: stage the row first
            uint8_t* staged = staged_base + row * row_bytes;
            warp_copy_batched(row_bytes / 16, lane, [&](int64_t j) { return load_nc(reinterpret_cast<const int4*>(src) + j); },
                              [&](int64_t j, const int4& v) { reinterpret_cast<int4*>(staged)[j] = v; });
            __threadfence_system();
            __syncwarp();
            src = staged;
        }
        warp_copy_to_peer(h, dst_base + i * row_bytes, src, row_bytes, pe, lane);
    }
    complete_warp_writes(h, pe);
    if (lane == 0) {
        signal_peer(h, combine_signals(L, h) + expert, make_signal(epoch, 0), pe);
        quiet_puts(h, pe);
    }
}

__global__ void __launch_bounds__(kSmallThreads) send_outputs_kernel(Layout L, Half h, const __nv_bfloat16* x, bool x_is_staged,
                                                                const int64_t* layout_range) {
    const int lane = threadIdx.x % kWarpSize;
    const int num_pairs = L.num_local_experts * L.num_ranks;
    for (int pair = blockIdx.x * kSmallWarps + threadIdx.x / kWarpSize; pair < num_pairs; pair += gridDim.x * kSmallWarps)
        send_pair_outputs(L, h, x, x_is_staged, layout_range, pair, lane);
}

// Waits for every expert's flag, then out[t] = sum over k (ascending) of w[t,k] * y[t,k], fp32, 8 channels per thread.
__global__ void __launch_bounds__(kThreads) reduce_outputs_kernel(Layout L, Half h, const int64_t* topk_idx, const float* topk_weights,
                                                                  const int* send_slot, int num_tokens, int num_topk, __nv_bfloat16* out) {
    __shared__ unsigned long long epoch_shared;
    if (threadIdx.x == 0) epoch_shared = h.state->epoch[h.half] + 1;
    __syncthreads();
    const unsigned long long epoch = epoch_shared;
    for (int e = threadIdx.x; e < L.num_experts; e += blockDim.x)
        wait_signal(combine_signals(L, h) + e, epoch, h, "combine receive", e / L.num_local_experts, e);
    __syncthreads();
    const int chunks = L.hidden / 8;
    const int64_t row_bytes = 2 * static_cast<int64_t>(L.hidden);
    const uint8_t* rows = h.local + L.recv_offset();
    for (int64_t item = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; item < static_cast<int64_t>(num_tokens) * chunks;
         item += static_cast<int64_t>(gridDim.x) * blockDim.x) {
        const int t = static_cast<int>(item / chunks), c = static_cast<int>(item % chunks);
        float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
        // The rows of kReduceBatch entries are loaded before any is summed (their latencies overlap); the sum
        // still runs over k ascending.
        constexpr int kReduceBatch = 4;
        for (int k0 = 0; k0 < num_topk; k0 += kReduceBatch) {
            int4 raw[kReduceBatch];
            float w[kReduceBatch];
            bool used[kReduceBatch];
#pragma unroll
            for (int u = 0; u < kReduceBatch; ++u) {
                const int k = k0 + u;
                const int64_t e = k < num_topk ? topk_idx[t * num_topk + k] : -1;
                used[u] = e >= 0;
                w[u] = 0.f;
                if (!used[u]) continue;
                w[u] = topk_weights[t * num_topk + k];
                const int slot = send_slot[t * num_topk + k];
                raw[u] = __ldcg(reinterpret_cast<const int4*>(rows + (e * L.max_tokens + slot) * row_bytes + c * 16));
            }
#pragma unroll
            for (int u = 0; u < kReduceBatch; ++u) {
                if (!used[u]) continue;
                const __nv_bfloat162* pairs = reinterpret_cast<const __nv_bfloat162*>(&raw[u]);
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    const float2 y = __bfloat1622float2(pairs[j]);
                    acc[2 * j] = __fadd_rn(acc[2 * j], __fmul_rn(w[u], y.x));
                    acc[2 * j + 1] = __fadd_rn(acc[2 * j + 1], __fmul_rn(w[u], y.y));
                }
            }
        }
        int4 result;
        __nv_bfloat162* packed = reinterpret_cast<__nv_bfloat162*>(&result);
#pragma unroll
        for (int j = 0; j < 4; ++j) packed[j] = __floats2bfloat162_rn(acc[2 * j], acc[2 * j + 1]);
        reinterpret_cast<int4*>(out)[item] = result;
    }
    finish_receive(L, h, epoch);
}

}  // namespace

Layout make_layout(int num_ranks, int num_experts, int max_tokens, int hidden) {
    EP_HOST_ASSERT(num_ranks > 0 && num_ranks <= kMaxRanks, "low-latency kernels support 1..", kMaxRanks, " ranks, got ", num_ranks);
    EP_HOST_ASSERT(num_experts % num_ranks == 0, "num_experts (", num_experts, ") must be a multiple of num_ranks (", num_ranks, ")");
    EP_HOST_ASSERT(hidden % kFp8GroupSize == 0, "hidden must be a multiple of 128, got ", hidden);
    Layout L{};
    L.num_ranks = num_ranks;
    L.num_experts = num_experts;
    L.num_local_experts = num_experts / num_ranks;
    L.max_tokens = max_tokens;
    L.hidden = hidden;
    L.dispatch_msg_bytes = align_up(kHeaderBytes + std::max<int64_t>(2 * hidden, hidden + hidden / kFp8GroupSize * 4), 16);
    const int64_t combine_msg_bytes = align_up(kHeaderBytes + 2 * int64_t(hidden), 16);
    const int64_t slots = int64_t(num_experts) * max_tokens;  // == E_local * R * T
    L.send_bytes = align_up(std::max(int64_t(max_tokens) * L.dispatch_msg_bytes, slots * combine_msg_bytes), 128);
    L.recv_bytes = align_up(slots * std::max(L.dispatch_msg_bytes, combine_msg_bytes), 128);
    L.signal_bytes = align_up(int64_t(num_experts) * 16 + int64_t(num_ranks) * 8, 128);
    L.half_bytes = L.send_bytes + L.recv_bytes + L.signal_bytes;
    return L;
}

void dispatch_send(const Layout& L, const Half& h, const void* x, const int64_t* topk_idx, int num_tokens, int num_topk, bool use_fp8,
                   bool round_scale, int* send_slot, cudaStream_t stream) {
    if (num_tokens > 0) {
        const int blocks = std::min(ceil_div(num_tokens, kSmallWarps), h.max_blocks * kSmallPerFull);
        const auto* xb = static_cast<const __nv_bfloat16*>(x);
        if (use_fp8) stage_tokens_kernel<true><<<blocks, kSmallThreads, 0, stream>>>(L, h, xb, num_tokens, round_scale);
        else stage_tokens_kernel<false><<<blocks, kSmallThreads, 0, stream>>>(L, h, xb, num_tokens, round_scale);
        EP_CUDA_CHECK(cudaGetLastError());
    }
    send_tokens_kernel<<<std::min(ceil_div(L.num_experts, kSmallWarps), h.max_blocks * kSmallPerFull), kSmallThreads, 0, stream>>>(
        L, h, topk_idx, num_tokens, num_topk, send_slot);
    EP_CUDA_CHECK(cudaGetLastError());
}

void dispatch_recv(const Layout& L, const Half& h, bool use_fp8, bool use_ue8m0, void* recv_x, void* recv_scales, int* src_info,
                   int64_t* layout_range, int* recv_count, int* cumulative_stats, cudaStream_t stream) {
    const size_t shared = (L.num_ranks + 1) * sizeof(int);
    // One block per local expert, capped by max_blocks: every block may spin on signals, and all ranks' blocks must
    // stay co-resident when ranks share a GPU.
    const dim3 grid(std::min(L.num_local_experts, h.max_blocks));
    if (!use_fp8)
        receive_tokens_kernel<false, false><<<grid, kThreads, shared, stream>>>(L, h, recv_x, recv_scales, src_info, layout_range, recv_count,
                                                                                 cumulative_stats);
    else if (use_ue8m0)
        receive_tokens_kernel<true, true><<<grid, kThreads, shared, stream>>>(L, h, recv_x, recv_scales, src_info, layout_range, recv_count,
                                                                               cumulative_stats);
    else
        receive_tokens_kernel<true, false><<<grid, kThreads, shared, stream>>>(L, h, recv_x, recv_scales, src_info, layout_range, recv_count,
                                                                                cumulative_stats);
    EP_CUDA_CHECK(cudaGetLastError());
}

void combine_send(const Layout& L, const Half& h, const void* x, bool x_is_staged, const int64_t* layout_range, cudaStream_t stream) {
    const int pairs = L.num_local_experts * L.num_ranks;
    send_outputs_kernel<<<std::min(ceil_div(pairs, kSmallWarps), h.max_blocks * kSmallPerFull), kSmallThreads, 0, stream>>>(L, h, static_cast<const __nv_bfloat16*>(x), x_is_staged,
                                                                           layout_range);
    EP_CUDA_CHECK(cudaGetLastError());
}

void combine_recv(const Layout& L, const Half& h, const int64_t* topk_idx, const float* topk_weights, const int* send_slot, int num_tokens,
                  int num_topk, void* out, int num_sms, cudaStream_t stream) {
    const int64_t items = int64_t(num_tokens) * (L.hidden / 8);
    const int blocks = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(std::min(num_sms, h.max_blocks), ceil_div<int64_t>(items, kThreads))));
    reduce_outputs_kernel<<<blocks, kThreads, 0, stream>>>(L, h, topk_idx, topk_weights, send_slot, num_tokens, num_topk,
                                                            static_cast<__nv_bfloat16*>(out));
    EP_CUDA_CHECK(cudaGetLastError());
}

}  // namespace ep::low_latency
