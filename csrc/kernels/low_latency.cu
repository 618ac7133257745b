// Low-latency kernels: see low_latency.cuh for the buffer layout and the protocol.

#include "kernels/nvshmem_device.cuh"  // first: it re-enables the half/bf16 operators NVSHMEM needs

#include "kernels/low_latency.cuh"

#include <cuda_fp8.h>

#include <algorithm>
#include <climits>
#include <map>
#include <mutex>
#include <utility>

#include "kernels/common.cuh"
#include "kernels/constants.h"
#include "kernels/copy.cuh"
#include "kernels/launch.cuh"
#include "kernels/pending_kernels.h"
#include "kernels/sync.cuh"

namespace ep::low_latency {
namespace {

constexpr int kThreads = 512;  // 16 warps: the receive kernel (a warp per message) and the sum
constexpr int kWarps = kThreads / kWarpSize;
// The warp-per-item kernels (send, combine send) run in small blocks: the same threads over 4x the SMs, so a
// few hundred warps spread over the GPU instead of piling onto max_blocks SMs. Their grids stay within the thread
// budget of max_blocks full blocks, and their registers are capped so that kSmallPerFull of them fit on one SM: all
// ranks' kernels on one GPU remain co-resident.
constexpr int kSmallThreads = 128;
constexpr int kSmallWarps = kSmallThreads / kWarpSize;
constexpr int kSmallPerFull = kThreads / kSmallThreads;

// Token-parallel send: a warp step covers one token's kStepChannels channels, kLaneChannels per lane (two 16-byte BF16
// vectors, one 16-byte FP8 vector), so a 128-channel FP8 group is kLanesPerGroup lanes and a step kGroupsPerStep groups.
constexpr int kLaneChannels = 16;
constexpr int kStepChannels = kWarpSize * kLaneChannels;
constexpr int kLanesPerGroup = kFp8GroupSize / kLaneChannels;
[[maybe_unused]] constexpr int kGroupsPerStep = kStepChannels / kFp8GroupSize;  // used by the NVSHMEM put path
constexpr int kSendBatch = 2;  // steps whose loads a warp issues before storing any (their latencies overlap)
// Combine send: a warp moves one chunk of a row at a time, the bytes one batched warp copy keeps in flight.
constexpr int64_t kChunkBytes = int64_t(kCopyBatch) * kCopyLanes * 16;

// ------------------------------------------------------------------ signals
__device__ __forceinline__ int4 load_nc(const int4* ptr) {
    int4 v;
    asm volatile("ld.global.nc.v4.s32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(ptr));
    return v;
}

// The address of `local` (a symmetric address in this half) on PE `pe` through the peer mapping (peer_base[pe] != 0).
template <typename T>
__device__ __forceinline__ T* peer_address(const Half& h, T* local, int pe) {
    return reinterpret_cast<T*>(h.peer_base[pe] + h.half_offset + (reinterpret_cast<const uint8_t*>(local) - h.local));
}

// Writes `value` into `signal` (a symmetric address in this half) on PE `pe`, after this thread's earlier writes
// (and those it has observed) to that PE: a release store through the peer mapping (cumulative: it also orders the
// writes of every block that arrive_last saw arrive), or an NVSHMEM fence + signal. One rank alone signals only
// itself (only its own kernels read the flag, on this GPU), and releases at GPU scope (verified on a GPU at one rank;
// a rank's signals to itself in larger groups could do the same, untested).
__device__ __forceinline__ void signal_peer(const Layout& L, const Half& h, uint64_t* signal, uint64_t value, int pe) {
    if (L.num_ranks == 1 && h.peer_base[pe] != 0) {
        sync::store_release_gpu(signal, value);
        return;
    }
    if (h.peer_base[pe] != 0) {
        sync::store_release_sys(peer_address(h, signal, pe), value);
        return;
    }
#ifdef EP_DISPATCHER_WITH_NVSHMEM
    nvshmem_fence();
    nvshmemx_signal_op(signal, value, NVSHMEM_SIGNAL_SET, pe);
#endif
}

// NVSHMEM puts are non-blocking: complete them before the staged source can be rewritten by a later call.
__device__ __forceinline__ void quiet_puts(const Half& h, int pe) {
#ifdef EP_DISPATCHER_WITH_NVSHMEM
    if (h.peer_base[pe] == 0) nvshmem_quiet();
#endif
}

__device__ __forceinline__ uint64_t make_signal(unsigned long long epoch, uint32_t low) {
    return (static_cast<uint64_t>(epoch) << 32) | low;
}

// Spins until `signal`'s epoch (upper 32 bits) equals `epoch`; returns the value. Times out with a report naming the
// peer and the expert (-1 for an ack).
__device__ __forceinline__ uint64_t wait_signal(const uint64_t* signal, unsigned long long epoch, const Half& h, sync::Stage stage,
                                                int peer, int expert) {
    const uint32_t want = static_cast<uint32_t>(epoch);
    sync::WaitSite site{stage, h.rank, peer};
    site.expert = expert;
    site.half = h.half;
    // Exact match: a stale value from an older epoch, or bytes left by a call of another shape, never passes.
    return sync::timed_wait(signal, [want](uint64_t v) { return static_cast<uint32_t>(v >> 32) == want; }, h.timeout_ns, epoch, site);
}

// wait_signal, and the SM clock cycles (clock64, as DeepEP) it spun added to `wait_stats[peer]` (int64 [R], accumulated
// across calls) when `record` (one waiting thread per signal in the grid, so each wait is counted once) and the
// caller passed stats. One atomicAdd per wait, after it ends: nothing is added per spin.
__device__ __forceinline__ uint64_t wait_signal_timed(const uint64_t* signal, unsigned long long epoch, const Half& h, sync::Stage stage,
                                                      int peer, int expert, int64_t* wait_stats, bool record) {
    const long long start = clock64();
    const uint64_t v = wait_signal(signal, epoch, h, stage, peer, expert);
    if (record && wait_stats != nullptr)
        atomicAdd(reinterpret_cast<unsigned long long*>(wait_stats + peer), static_cast<unsigned long long>(clock64() - start));
    return v;
}

__device__ __forceinline__ uint64_t* dispatch_signals(const Layout& L, const Half& h) {
    return reinterpret_cast<uint64_t*>(h.local + L.dispatch_signal_offset());
}
__device__ __forceinline__ uint64_t* combine_signals(const Layout& L, const Half& h) {
    return reinterpret_cast<uint64_t*>(h.local + L.combine_signal_offset());
}
__device__ __forceinline__ uint64_t* acks(const Layout& L, const Half& h) { return reinterpret_cast<uint64_t*>(h.local + L.ack_offset()); }
// Source rank `source`'s dispatch message at `slot` of local expert `local_expert`, in this half's receive area
// ([E_local][R][T] messages; a symmetric address: peer_address or a put reaches a peer's copy).
__device__ __forceinline__ uint8_t* dispatch_message(const Layout& L, const Half& h, int local_expert, int source, int slot) {
    return h.local + L.recv_offset() +
           ((static_cast<int64_t>(local_expert) * L.num_ranks + source) * L.max_tokens + slot) * L.dispatch_msg_bytes;
}

// A profiling stamp (Half::phase_trace, off when null): thread 0 records the global timer at `point` of `kernel`.
__device__ __forceinline__ void trace_phase(const Half& h, TraceKernel kernel, TracePoint point) {
    if (h.phase_trace != nullptr && threadIdx.x == 0 && blockIdx.x < kTraceBlocks)
        h.phase_trace[(int64_t(kernel) * kTraceBlocks + blockIdx.x) * kTracePoints + point] = sync::global_timer_ns();
}

// The epoch of the call now on this half (the half's calls so far + 1), read by one thread and shared with the block.
__device__ __forceinline__ unsigned long long call_epoch(const Half& h) {
    __shared__ unsigned long long epoch;
    if (threadIdx.x == 0) epoch = h.state->epoch[h.half] + 1;
    __syncthreads();
    return epoch;
}

// Run by a whole block before it writes into peers' halves: every peer has read this half's previous use (epoch - 1).
// Every sender writes (at least a signal) to every peer, so every block waits for every ack; after the first block
// the waits find them set.
__device__ __forceinline__ void wait_all_acks(const Layout& L, const Half& h, unsigned long long next_epoch, sync::Stage stage) {
    if (next_epoch > 1)
        for (int pe = threadIdx.x; pe < L.num_ranks; pe += blockDim.x) wait_signal(acks(L, h) + pe, next_epoch - 1, h, stage, pe, -1);
    __syncthreads();  // the acquiring threads' view passes to the whole block
}

// The last block to finish a kernel signals peers (release stores), so the arrival orders at system scope; one rank
// alone signals only itself, on this GPU, and GPU scope suffices (a system-scope fence costs microseconds). A grid of
// one block needs neither fence nor counter: the barrier puts every thread's writes before the signalling threads'
// release stores (signal_peer; put rows are complete, quiet_puts), which are cumulative. That is the zero-copy combine
// send's case: its arrival took 3.6 us (phase trace, 8 ranks, H100; 0.3 us without, RESULTS' twelfth session).
// `alone`: the same for a block that is the only one taking part in a larger grid (send_and_reduce_kernel's block 0).
__device__ __forceinline__ bool arrive_last(const Layout& L, unsigned int* counter, bool alone = false) {
    if (alone || gridDim.x == 1) {
        __syncthreads();
        return true;
    }
    return L.num_ranks == 1 ? sync::arrive_last<false>(counter) : sync::arrive_last<true>(counter);
}

// Run by the last block of a call's receive: the half's epoch advances and every sender learns that this rank has
// read the half.
__device__ __forceinline__ void acknowledge_half(const Layout& L, const Half& h, unsigned long long epoch) {
    if (threadIdx.x == 0) h.state->epoch[h.half] = epoch;
    for (int pe = threadIdx.x; pe < L.num_ranks; pe += blockDim.x) {
        signal_peer(L, h, acks(L, h) + h.rank, make_signal(epoch, 0), pe);
        quiet_puts(h, pe);
    }
}

// End of a receive kernel: the last block to finish acknowledges the half.
__device__ void finish_receive(const Layout& L, const Half& h, unsigned long long epoch, TraceKernel kernel) {
    trace_phase(h, kernel, kTraceMoved);
    const bool last = arrive_last(L, &h.state->arrived[h.half]);
    trace_phase(h, kernel, kTraceArrived);
    if (!last) return;
    acknowledge_half(L, h, epoch);
    trace_phase(h, kernel, kTraceSignaled);
}

// A bad topk_idx entry: skipped by the kernels, reported to the host as one record (later reports overwrite earlier
// ones; each is whole). The host reads it after its next launch (no sync) and raises.
__device__ __forceinline__ void report_bad_entry(const Half& h, ErrorCode code, int token, int k, int64_t value) {
    const int64_t clamped = value < INT_MIN ? INT_MIN : (value > INT_MAX ? INT_MAX : value);
    const uint64_t record = (static_cast<uint64_t>(code) << kErrorCodeShift) |
                            ((static_cast<uint64_t>(k) & kErrorKMask) << kErrorKShift) |
                            (static_cast<uint64_t>(min(token, static_cast<int>(kErrorTokenMask))) << kErrorTokenShift) |
                            static_cast<uint32_t>(static_cast<int32_t>(clamped));
    *reinterpret_cast<volatile unsigned long long*>(h.error) = record;
}

// Exclusive prefixes of the per-(local expert, source rank) counts, in shared memory:
//   begin[le * (R + 1) + r]: first slot of source r in expert le (r == R: the expert's total);
//   start[le]: first item of expert le when all experts' slots are numbered one after another (start[E_local] = all).
// `count(i)` gives the count of pair i = le * R + r (waiting for it if need be). Run by the whole block.
template <typename Count>
__device__ __forceinline__ void build_prefixes(const Layout& L, int* begin, int* start, Count&& count) {
    const int R = L.num_ranks, E_local = L.num_local_experts;
    for (int i = threadIdx.x; i < E_local * R; i += blockDim.x) begin[(i / R) * (R + 1) + i % R + 1] = count(i);
    __syncthreads();
    for (int le = threadIdx.x; le < E_local; le += blockDim.x) {
        int* b = begin + le * (R + 1);
        b[0] = 0;
        for (int r = 0; r < R; ++r) b[r + 1] += b[r];
    }
    __syncthreads();
    if (threadIdx.x < kWarpSize) {  // warp 0 scans the experts' totals, 32 at a time (E_local reaches hundreds at one rank)
        const int lane = threadIdx.x;
        int carry = 0;
        for (int base = 0; base < E_local; base += kWarpSize) {
            const int le = base + lane;
            int sum = le < E_local ? begin[le * (R + 1) + R] : 0;
#pragma unroll
            for (int offset = 1; offset < kWarpSize; offset <<= 1) {
                const int below = __shfl_up_sync(kFullWarpMask, sum, offset);
                if (lane >= offset) sum += below;
            }
            if (le < E_local) start[le + 1] = carry + sum;  // inclusive prefix: experts 0..le
            carry += __shfl_sync(kFullWarpMask, sum, kWarpSize - 1);
        }
        if (lane == 0) start[0] = 0;
    }
    __syncthreads();
}

// The last index i in [0, n) with values[i] <= key (values ascending, values[0] <= key < values[n]).
__device__ __forceinline__ int last_at_most(const int* values, int n, int key) {
    int found = 0;
    for (int lo = 0, hi = n - 1; lo <= hi;) {
        const int mid = (lo + hi) / 2;
        if (values[mid] <= key) found = mid, lo = mid + 1;
        else hi = mid - 1;
    }
    return found;
}

size_t prefix_shared_bytes(const Layout& L) {
    return (static_cast<size_t>(L.num_local_experts) * (L.num_ranks + 1) + L.num_local_experts + 1) * sizeof(int);
}

// The send kernel's per-block plan: count[E], count_after[E] and window_bits[E].
size_t plan_shared_bytes(const Layout& L) { return 3 * static_cast<size_t>(L.num_experts) * sizeof(int); }


// ------------------------------------------------------------------ FP8 cast (bit-exact with ep_dispatcher.fp8)
// The UE8M0 byte of a power-of-two fp32 scale: its biased exponent.
__device__ __forceinline__ uint32_t ue8m0_exponent(float scale) { return (__float_as_uint(scale) >> 23) & 0xffu; }

__device__ __forceinline__ float round_up_pow2(float scale) {
    const uint32_t bits = __float_as_uint(scale);
    if ((bits & 0x7fffffu) == 0) return scale;  // already a power of two
    return __uint_as_float((bits & 0xff800000u) + 0x800000u);
}

// Casts this lane's 16 channels (two 16-byte BF16 vectors) to FP8 with the scale of their 128-channel group (amax
// reduced over the group's kLanesPerGroup lanes; every lane of the warp must call it). Returns the 16 FP8 bytes.
__device__ __forceinline__ int4 cast_to_fp8(const int4 (&raw)[2], bool active, bool round_scale, float& scale) {
    float v[kLaneChannels];
    float amax = 0.f;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const __nv_bfloat162* pairs = reinterpret_cast<const __nv_bfloat162*>(&raw[i]);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const float2 f = __bfloat1622float2(pairs[j]);
            v[8 * i + 2 * j] = f.x;
            v[8 * i + 2 * j + 1] = f.y;
        }
    }
    if (active) {
#pragma unroll
        for (int j = 0; j < kLaneChannels; ++j) amax = fmaxf(amax, fabsf(v[j]));
    }
#pragma unroll
    for (int offset = kLanesPerGroup / 2; offset > 0; offset >>= 1) amax = fmaxf(amax, __shfl_xor_sync(kFullWarpMask, amax, offset));
    scale = __fdiv_rn(fmaxf(amax, kFp8AmaxFloor), kFp8Max);
    if (round_scale) scale = round_up_pow2(scale);
    uint32_t packed[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const __nv_fp8x2_storage_t lo = __nv_cvt_float2_to_fp8x2(make_float2(__fdiv_rn(v[4 * j], scale), __fdiv_rn(v[4 * j + 1], scale)),
                                                                 __NV_SATFINITE, __NV_E4M3);
        const __nv_fp8x2_storage_t hi = __nv_cvt_float2_to_fp8x2(
            make_float2(__fdiv_rn(v[4 * j + 2], scale), __fdiv_rn(v[4 * j + 3], scale)), __NV_SATFINITE, __NV_E4M3);
        packed[j] = static_cast<uint32_t>(lo) | (static_cast<uint32_t>(hi) << 16);
    }
    return make_int4(static_cast<int>(packed[0]), static_cast<int>(packed[1]), static_cast<int>(packed[2]), static_cast<int>(packed[3]));
}

// ------------------------------------------------------------------ dispatch: the send plan, per block
// The experts of token t that take a slot, in k order: expert[k], or -1 for -1 itself, an id outside [-1, E) and the
// second listing of an expert by one token (those two are reported when `report`, and skipped, so counts never exceed
// the tokens and slots stay inside the expert's region). A thread per token: its ids are loaded together, one round
// trip. The loops over the entries stay rolled (here and in plan_block_sends): every block plans every token of the
// call once, on SMs whose instruction cache is cold, and unrolled to kMaxTopk with the report path inlined at each
// entry the plan took twice the time (phase trace, 8 ranks x 128 tokens, H100: 23.8 -> 11.8 us, RESULTS' twelfth
// session) and the FP8 send kernel's code 122 KB (78 KB rolled).
__device__ __forceinline__ void planned_experts(const Layout& L, const Half& h, const int64_t* topk_idx, int t, int num_topk, bool report,
                                                int (&expert)[kMaxTopk]) {
    const int64_t* row = topk_idx + static_cast<int64_t>(t) * num_topk;
    int64_t id[kMaxTopk];
#pragma unroll
    for (int k = 0; k < kMaxTopk; ++k) id[k] = k < num_topk ? __ldg(row + k) : -1;
#pragma unroll 1
    for (int k = 0; k < num_topk; ++k) {
        const int64_t value = id[k];
        expert[k] = -1;
        if (value == -1) continue;
        if (value < -1 || value >= L.num_experts) {
            if (report) report_bad_entry(h, kErrorDispatchRange, t, k, value);
            continue;
        }
        // A repeat equals an earlier entry that took the expert (the first listing keeps it).
        bool repeat = false;
#pragma unroll 1
        for (int j = 0; j < k; ++j) repeat |= expert[j] == value;
        if (repeat) {
            if (report) report_bad_entry(h, kErrorDispatchRepeat, t, k, value);
            continue;
        }
        expert[k] = static_cast<int>(value);
    }
}

// The block's own tokens' entries (token token_begin + i, entry k at i * num_topk + k), in shared memory: the plan
// writes them once, and the warps that move the rows read them there instead of going back to global memory.
struct OwnEntries {
    uint8_t** message;  // the entry's message at its expert's rank, through the peer mapping; null: skipped, or put
    int* expert;        // the planned expert (-1: skipped)
    int* slot;          // its slot (-1: skipped)
};

// The own entries' arrays for `entries` entries, from `base` (8-byte aligned up) on; send_shared_bytes sizes them.
__device__ __forceinline__ OwnEntries own_entries_at(int* base, int entries) {
    auto* bytes = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(base) + 7) & ~uintptr_t{7});
    OwnEntries own;
    own.message = reinterpret_cast<uint8_t**>(bytes);
    own.expert = reinterpret_cast<int*>(bytes + static_cast<int64_t>(entries) * sizeof(uint8_t*));
    own.slot = own.expert + entries;
    return own;
}

// The send kernel's dynamic shared memory: the plan, then (8-byte aligned, as own_entries_at) the own entries of the
// most tokens one of `blocks` blocks takes: its items span at most this many tokens.
size_t send_shared_bytes(const Layout& L, int num_tokens, int num_topk, int blocks) {
    constexpr size_t kOwnEntryBytes = sizeof(uint8_t*) + 2 * sizeof(int);  // OwnEntries: message, expert, slot
    const int64_t steps = ceil_div(L.hidden, kStepChannels);
    const int64_t own_tokens = ceil_div<int64_t>(ceil_div<int64_t>(int64_t(num_tokens) * steps, blocks), steps) + 1;
    return plan_shared_bytes(L) + sizeof(uint8_t*) + static_cast<size_t>(own_tokens * num_topk) * kOwnEntryBytes;
}

// The send plan, computed by every block of the send kernel for itself (no plan kernel, no grid-wide scan): the
// slot of each entry of the block's tokens [token_begin, token_end) is its rank among this rank's entries for that
// expert in token order (as the reference's stable sort), written to send_slot (-1: skipped; the combine reads it)
// and to `own`; `count` (shared, [E]) ends as each expert's total, which the last block signals. One pass, a thread
// per token (one round trip to global memory), counts the tokens before the block's into `count` and those after
// into `count_after`, and keeps the block's own tokens' experts in `own`; then those go in windows of 32 (bit i of
// window_bits[e]: token window + i lists e; a slot adds the bits below its token). Block 0 reports bad entries.
__device__ __forceinline__ void plan_block_sends(const Layout& L, const Half& h, const int64_t* topk_idx, int num_tokens, int num_topk,
                                                 int token_begin, int token_end, int* send_slot, int* count, int* count_after,
                                                 unsigned* window_bits, const OwnEntries& own) {
    const int E = L.num_experts;
    const bool report = blockIdx.x == 0;
    for (int e = threadIdx.x; e < E; e += blockDim.x) count[e] = count_after[e] = 0;
    __syncthreads();
    for (int t = threadIdx.x; t < num_tokens; t += blockDim.x) {
        int expert[kMaxTopk];
        planned_experts(L, h, topk_idx, t, num_topk, report, expert);
        if (t >= token_begin && t < token_end) {
#pragma unroll 1
            for (int k = 0; k < num_topk; ++k) own.expert[(t - token_begin) * num_topk + k] = expert[k];
            continue;
        }
        int* counter = t < token_begin ? count : count_after;
#pragma unroll 1
        for (int k = 0; k < num_topk; ++k)
            if (expert[k] >= 0) atomicAdd(counter + expert[k], 1);
    }
    for (int window = token_begin; window < token_end; window += kWarpSize) {
        const int t = window + static_cast<int>(threadIdx.x);  // threads [0, 32) take the window's tokens
        const int i = t - token_begin;
        const bool mine = threadIdx.x < kWarpSize && t < token_end;
        for (int e = threadIdx.x; e < E; e += blockDim.x) window_bits[e] = 0;
        __syncthreads();  // also: the own experts and the counts of the tokens before the window are complete
        if (mine) {
#pragma unroll 1
            for (int k = 0; k < num_topk; ++k) {
                const int e = own.expert[i * num_topk + k];
                if (e >= 0) atomicOr(window_bits + e, 1u << threadIdx.x);
            }
        }
        __syncthreads();
        if (mine) {
            const unsigned below = (1u << threadIdx.x) - 1;
#pragma unroll 1
            for (int k = 0; k < num_topk; ++k) {
                const int e = own.expert[i * num_topk + k];
                const int slot = e < 0 ? -1 : count[e] + __popc(window_bits[e] & below);
                send_slot[t * num_topk + k] = slot;
                own.slot[i * num_topk + k] = slot;
                uint8_t* message = nullptr;
                const int pe = e < 0 ? 0 : e / L.num_local_experts;
                if (e >= 0 && L.num_ranks > 1 && h.peer_base[pe] != 0)
                    message = peer_address(h, dispatch_message(L, h, e % L.num_local_experts, h.rank, slot), pe);
                own.message[i * num_topk + k] = message;
            }
        }
        __syncthreads();
        for (int e = threadIdx.x; e < E; e += blockDim.x) count[e] += __popc(window_bits[e]);  // the thread that cleared e
    }
    __syncthreads();  // the counts of the tokens after are complete (a block may have no window)
    for (int e = threadIdx.x; e < E; e += blockDim.x) count[e] += count_after[e];
    __syncthreads();  // the own entries and the counts are complete
}

// One rank alone: this lane's part of step `step` of token t, stored into its packed places (DirectReceive) for each
// of the token's experts; lane_expert/lane_slot as in send_step. The UE8M0 scales of a step's four groups are one
// int32 word, which lane 0 assembles.
template <bool kUseFP8>
__device__ __forceinline__ void send_step_direct(const Layout& L, const DirectReceive& d, int t, int step, const int4 (&data)[2],
                                                 float scale, bool active, int lane_expert, int lane_slot, int num_topk, int lane) {
    constexpr int kBytesPerChannel = kUseFP8 ? 1 : 2;
    constexpr int kVectors = kUseFP8 ? 1 : 2;
    const int H = L.hidden, T = L.max_tokens, groups = H / kFp8GroupSize;
    const int channel = step * kStepChannels + lane * kLaneChannels;
    const int64_t row_bytes = int64_t(H) * kBytesPerChannel;
    uint32_t word = 0;  // UE8M0: the step's four scale exponents, assembled in lane 0 (a full step only)
    const bool full_word = kUseFP8 && d.use_ue8m0 && (step + 1) * kStepChannels <= H;
    if (full_word) {
#pragma unroll
        for (int g = 0; g < kStepChannels / kFp8GroupSize; ++g)
            word |= ue8m0_exponent(__shfl_sync(kFullWarpMask, scale, g * kLanesPerGroup)) << (8 * g);
    }
    for (int k = 0; k < num_topk; ++k) {
        const int slot = __shfl_sync(kFullWarpMask, lane_slot, k);
        const int expert = __shfl_sync(kFullWarpMask, lane_expert, k);
        if (slot < 0) continue;  // warp-uniform
        const int64_t row = static_cast<int64_t>(expert) * T + slot;  // one rank: every expert is local
        uint8_t* dst = static_cast<uint8_t*>(d.outputs.recv_x) + row * row_bytes + int64_t(channel) * kBytesPerChannel;
        if (active)
#pragma unroll
            for (int v = 0; v < kVectors; ++v) reinterpret_cast<int4*>(dst)[v] = data[v];
        if constexpr (kUseFP8) {
            if (d.use_ue8m0) {
                if (full_word && lane == 0)
                    static_cast<uint32_t*>(d.outputs.recv_scales)[(static_cast<int64_t>(expert) * (groups / 4) + step) * T + slot] = word;
            } else if (active && lane % kLanesPerGroup == 0) {
                static_cast<float*>(d.outputs.recv_scales)[(static_cast<int64_t>(expert) * groups + channel / kFp8GroupSize) * T + slot] = scale;
            }
        }
        if (step == 0 && lane == 0) d.outputs.src_info[row] = t;
    }
}

// One warp step of the token-parallel send: this lane's kLaneChannels channels of token `t` (`raw`, BF16), cast once
// (FP8) and stored into the token's message at each of its experts: `lane_expert`/`lane_slot`/`lane_message` of lane
// k describe entry k (slot -1: skipped; message: where a directly addressable peer holds it, else null). Step 0 also
// writes the header, FP8 lanes that lead a group the group's scale. kPuts: some peer is reached by NVSHMEM puts (the put
// path's code costs registers, so a kernel whose peers are all addressable leaves it out).
template <bool kUseFP8, bool kPuts>
__device__ __forceinline__ void send_step(const Layout& L, const Half& h, int t, int step, const int4 (&raw)[2], int lane_expert,
                                          int lane_slot, uint8_t* lane_message, int num_topk, bool round_scale, int lane,
                                          const DirectReceive& direct, bool& issued_puts) {
    constexpr int kBytesPerChannel = kUseFP8 ? 1 : 2;
    constexpr int kVectors = kUseFP8 ? 1 : 2;  // 16-byte vectors per lane
    const int H = L.hidden;
    const int channel = step * kStepChannels + lane * kLaneChannels;
    const bool active = channel < H;  // hidden % 128 == 0: a group's lanes are all active or all idle
    int4 data[2] = {raw[0], raw[1]};
    float scale = 0.f;
    if constexpr (kUseFP8) data[0] = cast_to_fp8(raw, active, round_scale, scale);
    if (L.num_ranks == 1) {
        send_step_direct<kUseFP8>(L, direct, t, step, data, scale, active, lane_expert, lane_slot, num_topk, lane);
        return;
    }
    const bool writes_scale = kUseFP8 && active && lane % kLanesPerGroup == 0;
    const int64_t data_offset = kHeaderBytes + int64_t(channel) * kBytesPerChannel;  // in the message
    const int64_t scale_offset = kHeaderBytes + H + (channel / kFp8GroupSize) * int64_t(sizeof(float));
    const int4 header = make_int4(t, 0, 0, 0);

    // Peers reached by NVSHMEM puts read the step from the token's staged message (a put's source is symmetric).
    uint8_t* staged = h.local + L.send_offset() + int64_t(t) * L.dispatch_msg_bytes;
    if (kPuts && __ballot_sync(kFullWarpMask, lane_slot >= 0 && lane_message == nullptr) != 0) {
        if (active)
#pragma unroll
            for (int v = 0; v < kVectors; ++v) reinterpret_cast<int4*>(staged + data_offset)[v] = data[v];
        if (writes_scale) *reinterpret_cast<float*>(staged + scale_offset) = scale;
        if (step == 0 && lane == 0) *reinterpret_cast<int4*>(staged) = header;
        __threadfence_system();
        __syncwarp();
    }
    for (int k = 0; k < num_topk; ++k) {
        // The plan computed the message's address: the common case costs a shuffle and the stores.
        uint8_t* dst = reinterpret_cast<uint8_t*>(__shfl_sync(kFullWarpMask, reinterpret_cast<uintptr_t>(lane_message), k));
        if (dst != nullptr) {  // warp-uniform
            if (active)
#pragma unroll
                for (int v = 0; v < kVectors; ++v) reinterpret_cast<int4*>(dst + data_offset)[v] = data[v];
            if (writes_scale) *reinterpret_cast<float*>(dst + scale_offset) = scale;
            if (step == 0 && lane == 0) *reinterpret_cast<int4*>(dst) = header;
            continue;
        }
#ifdef EP_DISPATCHER_WITH_NVSHMEM
        if constexpr (!kPuts) continue;
        const int slot = __shfl_sync(kFullWarpMask, lane_slot, k);
        const int expert = __shfl_sync(kFullWarpMask, lane_expert, k);
        if (slot < 0) continue;  // warp-uniform
        const int pe = expert / L.num_local_experts;
        uint8_t* msg = dispatch_message(L, h, expert % L.num_local_experts, h.rank, slot);
        const int step_channels = min(kStepChannels, H - step * kStepChannels);
        const int64_t step_begin = kHeaderBytes + int64_t(step) * kStepChannels * kBytesPerChannel;
        nvshmemx_putmem_nbi_warp(msg + step_begin, staged + step_begin, static_cast<size_t>(step_channels) * kBytesPerChannel, pe);
        if (kUseFP8) {
            const int64_t scales_begin = kHeaderBytes + H + int64_t(step) * kGroupsPerStep * sizeof(float);
            nvshmemx_putmem_nbi_warp(msg + scales_begin, staged + scales_begin, (step_channels / kFp8GroupSize) * sizeof(float), pe);
        }
        if (step == 0) nvshmemx_putmem_nbi_warp(msg, staged, kHeaderBytes, pe);
        issued_puts = true;
#endif
    }
}

// one_rank_fused: the receive's outputs from the plan's totals (count[e], every block's). Block 0 writes the counts,
// ranges and stats; every block marks its share of the unused slots (slot >= count: the send stores the used ones'
// sources, so the two never meet).
__device__ __forceinline__ void publish_lone_receive(const Layout& L, const ReceiveOutputs& o, const int* count) {
    const int E = L.num_experts, T = L.max_tokens;
    if (blockIdx.x == 0) {
        for (int e = threadIdx.x; e < E; e += blockDim.x) {
            o.recv_count[e] = count[e];
            o.layout_range[e] = count[e];  // (first slot 0) << 32 | count
            if (o.cumulative_stats != nullptr) o.cumulative_stats[e] += count[e];
        }
    }
    const int64_t num_threads = static_cast<int64_t>(gridDim.x) * blockDim.x;
    for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < static_cast<int64_t>(E) * T; i += num_threads)
        if (i % T >= count[i / T]) o.src_info[i] = -1;
}

// Token-parallel send: each block takes a contiguous range of (token, step) items, so its tokens are few and adjacent,
// plans their slots (plan_block_sends), then a warp per item, kSendBatch items' loads in flight. Each token row is read
// once and each step cast once, then stored into its slots. The last block to finish signals every expert's count
// (after all blocks' writes, see arrive_last).
// Returns the call's epoch; every block returns (send_and_receive_kernel goes on to receive).
template <bool kUseFP8, bool kPuts>
__device__ __forceinline__ unsigned long long send_tokens(const Layout& L, const Half& h, const __nv_bfloat16* x, const int64_t* topk_idx,
                                                          int* send_slot, int num_tokens, int num_topk, bool round_scale,
                                                          const DirectReceive& direct, int* plan_shared) {
    int* count = plan_shared;                                                              // [E]
    int* count_after = plan_shared + L.num_experts;                                        // [E]
    unsigned* window_bits = reinterpret_cast<unsigned*>(plan_shared + 2 * L.num_experts);  // [E]
    trace_phase(h, kTraceSend, kTraceStart);
    const int H = L.hidden;
    const int steps = ceil_div(H, kStepChannels);
    // Items are counted in 32 bits (dispatch_send checks num_tokens * steps): a 64-bit division per item costs more
    // than the item's stores.
    const int64_t items = static_cast<int64_t>(num_tokens) * steps;
    const int item_begin = static_cast<int>(items * blockIdx.x / gridDim.x);
    const int item_end = static_cast<int>(items * (blockIdx.x + 1) / gridDim.x);
    const int token_begin = item_begin / steps;
    const int token_end = item_end > item_begin ? (item_end - 1) / steps + 1 : token_begin;
    // The own entries follow the counters (send_shared_bytes): messages, experts, slots.
    const int own_entries = (token_end - token_begin) * num_topk;
    const OwnEntries own = own_entries_at(plan_shared + 3 * L.num_experts, own_entries);
    // The plan needs nothing from the peers: it runs before the wait for their acks.
    plan_block_sends(L, h, topk_idx, num_tokens, num_topk, token_begin, token_end, send_slot, count, count_after, window_bits, own);
    const bool fused_receive = L.num_ranks == 1 && direct.publish;  // one_rank_fused
    if (fused_receive) publish_lone_receive(L, direct.outputs, count);
    trace_phase(h, kTraceSend, kTracePrepared);
    const unsigned long long epoch = h.state->epoch[h.half] + 1;
    wait_all_acks(L, h, epoch, sync::kStageLowLatencyDispatchSend);
    trace_phase(h, kTraceSend, kTraceWaited);
    const int lane = threadIdx.x % kWarpSize;
    [[maybe_unused]] bool issued_puts = false;  // NVSHMEM builds: this warp's puts to complete before arriving
    for (int base = item_begin + static_cast<int>(threadIdx.x) / kWarpSize; base < item_end; base += kSmallWarps * kSendBatch) {
        int4 raw[kSendBatch][2];
        int lane_expert[kSendBatch], lane_slot[kSendBatch], token[kSendBatch], step[kSendBatch];
        uint8_t* lane_message[kSendBatch];
#pragma unroll
        for (int u = 0; u < kSendBatch; ++u) {
            const int item = base + u * kSmallWarps;
            raw[u][0] = raw[u][1] = make_int4(0, 0, 0, 0);
            lane_expert[u] = lane_slot[u] = -1;
            lane_message[u] = nullptr;
            token[u] = item / steps;
            step[u] = item - token[u] * steps;
            if (item >= item_end) continue;
            const int t = token[u], channel = step[u] * kStepChannels + lane * kLaneChannels;
            if (channel < H) {
                const int4* row = reinterpret_cast<const int4*>(x + static_cast<int64_t>(t) * H + channel);
                raw[u][0] = load_nc(row);
                raw[u][1] = load_nc(row + 1);
            }
            if (lane < num_topk) {  // a slot >= 0 guarantees a valid expert (the plan checked it)
                const int entry = (t - token_begin) * num_topk + lane;
                lane_slot[u] = own.slot[entry];
                lane_expert[u] = own.expert[entry];
                lane_message[u] = own.message[entry];
            }
        }
#pragma unroll
        for (int u = 0; u < kSendBatch; ++u) {
            if (base + u * kSmallWarps >= item_end) break;  // warp-uniform
            send_step<kUseFP8, kPuts>(L, h, token[u], step[u], raw[u], lane_expert[u], lane_slot[u], lane_message[u], num_topk,
                                      round_scale, lane, direct, issued_puts);
        }
    }
#ifdef EP_DISPATCHER_WITH_NVSHMEM
    if (kPuts && issued_puts) nvshmem_quiet();  // every lane completes its puts before the block arrives
#endif
    trace_phase(h, kTraceSend, kTraceMoved);
    const bool last = arrive_last(L, &h.state->send_arrived[h.half]);
    trace_phase(h, kTraceSend, kTraceArrived);
    if (!last) return epoch;
    if (fused_receive) {  // no receive kernel reads the counts: this one ends the call as that did
        acknowledge_half(L, h, epoch);
    } else {
        for (int expert = threadIdx.x; expert < L.num_experts; expert += blockDim.x) {
            const int pe = expert / L.num_local_experts, local_expert = expert % L.num_local_experts;
            signal_peer(L, h, dispatch_signals(L, h) + local_expert * L.num_ranks + h.rank,
                        make_signal(epoch, static_cast<uint32_t>(count[expert])), pe);
            quiet_puts(h, pe);
        }
    }
    trace_phase(h, kTraceSend, kTraceSignaled);
    return epoch;
}

template <bool kUseFP8, bool kPuts>
__global__ void __launch_bounds__(kSmallThreads, kSmallPerFull)
    send_tokens_kernel(Layout L, Half h, const __nv_bfloat16* x, const int64_t* topk_idx, int* send_slot, int num_tokens,
                       int num_topk, bool round_scale, DirectReceive direct) {
    wait_for_previous_kernel();
    let_next_kernel_start();
    extern __shared__ __align__(16) int plan_shared[];
    send_tokens<kUseFP8, kPuts>(L, h, x, topk_idx, send_slot, num_tokens, num_topk, round_scale, direct, plan_shared);
}

// Every block waits for all counts and builds the prefixes (in `prefix`, prefix_shared_bytes); then a warp per received
// message (all experts' messages numbered one after another, spread over the grid, whatever its block size) copies it to
// its packed place: source ranks ascending, token order inside a source. Block 0 writes the counts and the handle's
// ranges; all blocks mark the unused slots.
template <bool kUseFP8, bool kUE8M0>
__device__ __forceinline__ void receive_messages(const Layout& L, const Half& h, unsigned long long epoch, int* prefix, const ReceiveOutputs& o) {
    const int R = L.num_ranks, T = L.max_tokens, H = L.hidden, E_local = L.num_local_experts;
    const int num_slots = R * T;
    int* begin = prefix;
    int* start = prefix + E_local * (R + 1);
    trace_phase(h, kTraceReceive, kTraceStart);
    // Every block waits for every count; block 0's waits are the ones recorded: one per (local expert, source rank), as
    // DeepEP adds one per (expert, source) it waits for.
    build_prefixes(L, begin, start, [&](int pair) {
        const uint64_t v = wait_signal_timed(dispatch_signals(L, h) + pair, epoch, h, sync::kStageLowLatencyDispatchRecv, pair % R,
                                             h.rank * E_local + pair / R, o.wait_stats, blockIdx.x == 0);
        return static_cast<int>(v & 0xffffffffu);
    });
    trace_phase(h, kTraceReceive, kTracePrepared);
    trace_phase(h, kTraceReceive, kTraceWaited);
    if (blockIdx.x == 0) {
        for (int le = threadIdx.x; le < E_local; le += blockDim.x) {
            const int total = begin[le * (R + 1) + R];
            o.recv_count[le] = total;
            if (o.cumulative_stats != nullptr) o.cumulative_stats[le] += total;
        }
        for (int pair = threadIdx.x; pair < E_local * R; pair += blockDim.x) {
            const int* b = begin + (pair / R) * (R + 1) + pair % R;
            o.layout_range[pair] = (static_cast<int64_t>(b[0]) << 32) | static_cast<int64_t>(b[1] - b[0]);
        }
    }
    const int64_t num_threads = static_cast<int64_t>(gridDim.x) * blockDim.x;
    for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < static_cast<int64_t>(E_local) * num_slots;
         i += num_threads)
        if (i % num_slots >= begin[(i / num_slots) * (R + 1) + R]) o.src_info[i] = -1;

    const int lane = threadIdx.x % kWarpSize, warps = blockDim.x / kWarpSize;
    const int groups = H / kFp8GroupSize;
    const int64_t row_bytes = kUseFP8 ? H : 2 * H;
    const int items = R == 1 ? 0 : start[E_local];  // one rank alone: its send kernel stored the rows in place
    for (int item = blockIdx.x * warps + threadIdx.x / kWarpSize; item < items; item += gridDim.x * warps) {
        const int local_expert = last_at_most(start, E_local, item);
        const int slot = item - start[local_expert];
        const int* b = begin + local_expert * (R + 1);
        const int r = last_at_most(b, R, slot);  // source rank of this slot
        const uint8_t* msg = dispatch_message(L, h, local_expert, r, slot - b[r]);
        const int64_t out_row = static_cast<int64_t>(local_expert) * num_slots + slot;
        // Received bytes are read with ld.global.cg (L2, not L1): peers wrote them after this SM may have cached the lines.
        const int4* in = reinterpret_cast<const int4*>(msg + kHeaderBytes);
        int4* out = reinterpret_cast<int4*>(static_cast<uint8_t*>(o.recv_x) + out_row * row_bytes);
        warp_copy_batched(row_bytes / 16, lane, [&](int64_t i) { return __ldcg(in + i); }, [&](int64_t i, const int4& v) { out[i] = v; });
        if (lane == 0) o.src_info[out_row] = __ldcg(reinterpret_cast<const int*>(msg));
        if constexpr (kUseFP8) {
            const float* scales = reinterpret_cast<const float*>(msg + kHeaderBytes + H);
            // Scales are stored group-major ([E_local, groups, num_slots]) and returned as a transposed view.
            if constexpr (kUE8M0) {
                for (int word = lane; word < groups / 4; word += kWarpSize) {
                    uint32_t packed = 0;
#pragma unroll
                    for (int b4 = 0; b4 < 4; ++b4) packed |= ue8m0_exponent(__ldcg(scales + 4 * word + b4)) << (8 * b4);
                    static_cast<uint32_t*>(o.recv_scales)[(static_cast<int64_t>(local_expert) * (groups / 4) + word) * num_slots + slot] =
                        packed;
                }
            } else {
                for (int g = lane; g < groups; g += kWarpSize)
                    static_cast<float*>(o.recv_scales)[(static_cast<int64_t>(local_expert) * groups + g) * num_slots + slot] =
                        __ldcg(scales + g);
            }
        }
    }
    finish_receive(L, h, epoch, kTraceReceive);
}

template <bool kUseFP8, bool kUE8M0>
__global__ void __launch_bounds__(kThreads) receive_tokens_kernel(Layout L, Half h, ReceiveOutputs o) {
    wait_for_previous_kernel();
    let_next_kernel_start();
    extern __shared__ int prefix[];
    receive_messages<kUseFP8, kUE8M0>(L, h, call_epoch(h), prefix, o);
}

// One dispatch in one kernel (send_and_receive_kernel): the send, then, in every block, the receive. Every block of
// every rank's kernel is resident (the grid stays within max_blocks, as each kernel's does), so a block that waits for
// the counts never holds an SM that a block still to send needs. Saves a launch and a kernel boundary per call.
template <bool kUseFP8, bool kPuts, bool kUE8M0>
__global__ void __launch_bounds__(kSmallThreads, kSmallPerFull)
    send_and_receive_kernel(Layout L, Half h, const __nv_bfloat16* x, const int64_t* topk_idx, int* send_slot, int num_tokens,
                            int num_topk, bool round_scale, DirectReceive direct, ReceiveOutputs o) {
    wait_for_previous_kernel();
    let_next_kernel_start();
    extern __shared__ __align__(16) int plan_shared[];
    const unsigned long long epoch =
        send_tokens<kUseFP8, kPuts>(L, h, x, topk_idx, send_slot, num_tokens, num_topk, round_scale, direct, plan_shared);
    __syncthreads();  // the send's shared memory (plan, own entries) is the receive's prefixes from here on
    receive_messages<kUseFP8, kUE8M0>(L, h, epoch, plan_shared, o);
}

// ------------------------------------------------------------------ combine
// Sources whose rank is directly addressable (peer_base != 0) pull their rows: the expert outputs stay in this rank's
// send area ([E_local, R * T, H], the zero-copy buffer) and each source's reduce reads them there. Only rows for
// sources reached by NVSHMEM puts are pushed, to [global expert][i] of their receive area (i: the slot the source chose
// in dispatch). So the send phase moves: nothing with zero copy and direct peers; with an ordinary `x`, one local copy
// of each pulled row into the send area (the rows must outlive `x`: the sources read them later) and one push of each
// other row; a warp per (row, kChunkBytes chunk), spread over the grid. The last block to finish flags every (expert,
// source rank) pair with the first slot of that source's range (where its pull starts).
// Rewriting the send area waits for the acks of this half's previous use, which every source sends after its reduce.
// `alone`: no other block of the grid takes part (nothing to arrive for). `prefix`: prefix_shared_bytes.
__device__ __forceinline__ void send_outputs(const Layout& L, const Half& h, unsigned long long epoch, const __nv_bfloat16* x,
                                             bool x_is_staged, bool all_peers_direct, const int64_t* layout_range, bool alone, int* prefix) {
    const int R = L.num_ranks, T = L.max_tokens, E_local = L.num_local_experts;
    int* begin = prefix;
    int* start = prefix + E_local * (R + 1);
    trace_phase(h, kTraceCombineSend, kTraceStart);
    wait_all_acks(L, h, epoch, sync::kStageLowLatencyCombineSend);
    trace_phase(h, kTraceCombineSend, kTracePrepared);
    // The ranges are the exclusive prefixes of their counts (the receive kernel wrote them so).
    build_prefixes(L, begin, start, [&](int pair) { return static_cast<int>(layout_range[pair] & 0xffffffff); });
    trace_phase(h, kTraceCombineSend, kTraceWaited);
    const int lane = threadIdx.x % kWarpSize;
    const int64_t row_bytes = 2 * static_cast<int64_t>(L.hidden);
    const int64_t num_slots = static_cast<int64_t>(R) * T;
    const int chunks = static_cast<int>(ceil_div(row_bytes, kChunkBytes));
    // Zero copy with every peer addressable: every row is already where its source reads it. Skipping the walk matters:
    // this case runs one block, and visiting each (row, chunk) only to skip it took 660 µs at 8 ranks x 128 tokens.
    const int64_t items = x_is_staged && all_peers_direct ? 0 : static_cast<int64_t>(start[E_local]) * chunks;
    [[maybe_unused]] bool issued_puts = false;  // NVSHMEM builds: this warp's puts to complete before arriving
    for (int64_t item = blockIdx.x * kSmallWarps + threadIdx.x / kWarpSize; item < items; item += gridDim.x * kSmallWarps) {
        const int row = static_cast<int>(item / chunks), chunk = static_cast<int>(item % chunks);
        const int local_expert = last_at_most(start, E_local, row);
        const int slot = row - start[local_expert];
        const int* b = begin + local_expert * (R + 1);
        const int pe = last_at_most(b, R, slot);  // the row's source rank
        const bool pulled = h.peer_base[pe] != 0;
        if (pulled && x_is_staged) continue;  // warp-uniform: the row is where the source reads it
        const int64_t offset = chunk * kChunkBytes, bytes = row_bytes - offset < kChunkBytes ? row_bytes - offset : kChunkBytes;
        const int64_t src_row = local_expert * num_slots + slot;
        const uint8_t* src = reinterpret_cast<const uint8_t*>(x) + src_row * row_bytes + offset;
        uint8_t* staged = h.local + L.send_offset() + src_row * row_bytes + offset;
        if (!x_is_staged) {  // into the send area: pulled from there, or the source of an NVSHMEM put
            warp_copy_batched(bytes / 16, lane, [&](int64_t j) { return load_nc(reinterpret_cast<const int4*>(src) + j); },
                              [&](int64_t j, const int4& v) { reinterpret_cast<int4*>(staged)[j] = v; });
            if (pulled) continue;
            __threadfence_system();
            __syncwarp();
        }
        uint8_t* dst =
            h.local + L.recv_offset() + ((static_cast<int64_t>(h.rank) * E_local + local_expert) * T + (slot - b[pe])) * row_bytes + offset;
#ifdef EP_DISPATCHER_WITH_NVSHMEM
        nvshmemx_putmem_nbi_warp(dst, staged, static_cast<size_t>(bytes), pe);  // non-blocking; completed before arriving
        issued_puts = true;
#endif
    }
#ifdef EP_DISPATCHER_WITH_NVSHMEM
    if (issued_puts) nvshmem_quiet();  // every lane completes its puts before the block arrives
#endif
    trace_phase(h, kTraceCombineSend, kTraceMoved);
    const bool last = arrive_last(L, &h.state->send_arrived[h.half], alone);
    trace_phase(h, kTraceCombineSend, kTraceArrived);
    if (!last) return;
    for (int pair = threadIdx.x; pair < E_local * R; pair += blockDim.x) {
        const int pe = pair % R, local_expert = pair / R;
        const int first = begin[local_expert * (R + 1) + pe];
        signal_peer(L, h, combine_signals(L, h) + h.rank * E_local + local_expert, make_signal(epoch, static_cast<uint32_t>(first)), pe);
        quiet_puts(h, pe);
    }
    trace_phase(h, kTraceCombineSend, kTraceSignaled);
}

__global__ void __launch_bounds__(kSmallThreads, kSmallPerFull)
    send_outputs_kernel(Layout L, Half h, const __nv_bfloat16* x, bool x_is_staged, bool all_peers_direct, const int64_t* layout_range) {
    wait_for_previous_kernel();
    let_next_kernel_start();
    extern __shared__ int prefix[];
    send_outputs(L, h, h.state->epoch[h.half] + 1, x, x_is_staged, all_peers_direct, layout_range, false, prefix);
}

// Waits for every expert's flag, then out[t] = sum over k (ascending) of w[t,k] * y[t,k], fp32, BF16 out.
// y[t,k] is read where the expert's rank holds it (its send area, from the first slot its flag carries) when that rank
// is directly addressable, else from this rank's receive area (pushed). Entries without a slot (-1, skipped in
// dispatch) add nothing; ids out of range are reported and skipped.
// A warp per (token, part of the hidden dimension): lane k resolves entry k (id, slot, weight -> the row's address)
// once, into shared memory, then each lane walks its 16-byte chunks two at a time, the rows of kRowBatch entries in
// flight before any is summed. (A thread per chunk redid a token's index, slot and address arithmetic for every
// chunk: ncu found that integer work, not memory, bounding the kernel.)
// `first_slot`: [E] ints of shared memory (where this rank's range starts in each expert's outputs). Any block size.
// `rows_in_place`: one_rank_fused's zero-copy combine (no flags to wait for).
__device__ __forceinline__ void reduce_outputs(const Layout& L, const Half& h, unsigned long long epoch, const ReduceArgs& a,
                                               bool rows_in_place, int* first_slot) {
    __shared__ const int4* entry_row[kWarps][kMaxTopk];  // each warp's current token: entry k's row, null: adds nothing
    __shared__ float entry_weight[kWarps][kMaxTopk];
    const int64_t* topk_idx = a.topk_idx;
    const float* topk_weights = a.topk_weights;
    const int* send_slot = a.send_slot;
    const int num_tokens = a.num_tokens, num_topk = a.num_topk;
    auto* out = static_cast<__nv_bfloat16*>(a.out);
    int64_t* wait_stats = a.wait_stats;
    trace_phase(h, kTraceReduce, kTraceStart);
    const int E_local = L.num_local_experts;
    if (rows_in_place) {  // one_rank_fused: no combine send flagged the experts
        wait_all_acks(L, h, epoch, sync::kStageLowLatencyCombineSend);
        for (int e = threadIdx.x; e < L.num_experts; e += blockDim.x) first_slot[e] = 0;
    } else {
        // Block 0's waits are recorded: one per expert, added to the rank that holds it (as DeepEP).
        for (int e = threadIdx.x; e < L.num_experts; e += blockDim.x)
            first_slot[e] = static_cast<int>(wait_signal_timed(combine_signals(L, h) + e, epoch, h, sync::kStageLowLatencyCombineRecv,
                                                               e / E_local, e, wait_stats, blockIdx.x == 0) &
                                             0xffffffffu);
    }
    __syncthreads();
    trace_phase(h, kTraceReduce, kTracePrepared);
    trace_phase(h, kTraceReduce, kTraceWaited);
    const int chunks = L.hidden / 8;
    const int64_t row_bytes = 2 * static_cast<int64_t>(L.hidden);
    const int64_t num_slots = static_cast<int64_t>(L.num_ranks) * L.max_tokens;
    const uint8_t* pushed = h.local + L.recv_offset();
    // The address of row `slot` of this rank's range at expert e.
    const auto row_of = [&](int64_t e, int slot) -> const int4* {
        const int pe = static_cast<int>(e / E_local);
        if (h.peer_base[pe] == 0) return reinterpret_cast<const int4*>(pushed + (e * L.max_tokens + slot) * row_bytes);
        const int64_t at = L.send_offset() + ((e % E_local) * num_slots + first_slot[e] + slot) * row_bytes;
        return reinterpret_cast<const int4*>(h.peer_base[pe] + h.half_offset + at);
    };
    const int warp = static_cast<int>(threadIdx.x) / kWarpSize, lane = static_cast<int>(threadIdx.x) % kWarpSize;
    const int warps = static_cast<int>(blockDim.x) / kWarpSize;  // <= kWarps
    const int total_warps = static_cast<int>(gridDim.x) * warps;
    // Few tokens: each is cut into parts so that every warp has one (at most a chunk per lane per part).
    const int parts = max(1, min(ceil_div(total_warps, max(num_tokens, 1)), ceil_div(chunks, kWarpSize)));
    const int64_t items = static_cast<int64_t>(num_tokens) * parts;
    constexpr int kRowBatch = 8;
    for (int64_t item = static_cast<int64_t>(blockIdx.x) * warps + warp; item < items; item += total_warps) {
        const int t = static_cast<int>(item / parts), part = static_cast<int>(item % parts);
        if (lane < num_topk) {
            const int64_t entry = static_cast<int64_t>(t) * num_topk + lane;
            const int64_t e = __ldg(topk_idx + entry);
            const int slot = send_slot[entry];
            const bool valid = e >= 0 && e < L.num_experts;
            if (part == 0 && !valid && e != -1) report_bad_entry(h, kErrorCombineRange, t, lane, e);
            entry_row[warp][lane] = valid && slot >= 0 ? row_of(e, slot) : nullptr;
            entry_weight[warp][lane] = __ldg(topk_weights + entry);
        }
        __syncwarp();
        const int c_end = static_cast<int>(static_cast<int64_t>(chunks) * (part + 1) / parts);
        for (int c0 = static_cast<int>(static_cast<int64_t>(chunks) * part / parts) + lane; c0 < c_end; c0 += 2 * kWarpSize) {
            const int c[2] = {c0, c0 + kWarpSize};
            const bool second = c[1] < c_end;
            float acc[2][8] = {};
            for (int k0 = 0; k0 < num_topk; k0 += kRowBatch) {
                const int4* row[kRowBatch];
                int4 raw[kRowBatch][2];
#pragma unroll
                for (int u = 0; u < kRowBatch; ++u) {
                    row[u] = k0 + u < num_topk ? entry_row[warp][k0 + u] : nullptr;
                    if (row[u] == nullptr) continue;
                    raw[u][0] = __ldcg(row[u] + c[0]);
                    if (second) raw[u][1] = __ldcg(row[u] + c[1]);
                }
#pragma unroll
                for (int u = 0; u < kRowBatch; ++u) {  // k ascending, as the reference
                    if (row[u] == nullptr) continue;
                    const float w = entry_weight[warp][k0 + u];
#pragma unroll
                    for (int v = 0; v < 2; ++v) {
                        const __nv_bfloat162* pairs = reinterpret_cast<const __nv_bfloat162*>(&raw[u][v]);
#pragma unroll
                        for (int j = 0; j < 4; ++j) {
                            const float2 y = __bfloat1622float2(pairs[j]);
                            acc[v][2 * j] = __fadd_rn(acc[v][2 * j], __fmul_rn(w, y.x));
                            acc[v][2 * j + 1] = __fadd_rn(acc[v][2 * j + 1], __fmul_rn(w, y.y));
                        }
                    }
                }
            }
#pragma unroll
            for (int v = 0; v < 2; ++v) {
                if (v == 1 && !second) break;
                int4 result;
                __nv_bfloat162* packed = reinterpret_cast<__nv_bfloat162*>(&result);
#pragma unroll
                for (int j = 0; j < 4; ++j) packed[j] = __floats2bfloat162_rn(acc[v][2 * j], acc[v][2 * j + 1]);
                reinterpret_cast<int4*>(out)[static_cast<int64_t>(t) * chunks + c[v]] = result;
            }
        }
        __syncwarp();  // the entries are read before this warp's next token overwrites them
    }
    finish_receive(L, h, epoch, kTraceReduce);
}

__global__ void __launch_bounds__(kThreads) reduce_outputs_kernel(Layout L, Half h, ReduceArgs a, bool rows_in_place) {
    wait_for_previous_kernel();
    let_next_kernel_start();
    extern __shared__ int first_slot[];
    reduce_outputs(L, h, call_epoch(h), a, rows_in_place, first_slot);
}

// One combine in one kernel (send_and_reduce_kernel): the send, then, in every block, the reduce (residency as in
// send_and_receive_kernel). With the zero-copy buffer and every peer addressable no row moves, so block 0 alone waits
// for the acks and flags the sources, and no block arrives. Saves a launch and a kernel boundary per call.
__global__ void __launch_bounds__(kSmallThreads, kSmallPerFull)
    send_and_reduce_kernel(Layout L, Half h, const __nv_bfloat16* x, bool x_is_staged, bool all_peers_direct, const int64_t* layout_range,
                           ReduceArgs a) {
    wait_for_previous_kernel();
    let_next_kernel_start();
    extern __shared__ int combine_shared[];  // the send's prefixes, then the reduce's first slots
    const unsigned long long epoch = call_epoch(h);
    const bool rows_move = !(x_is_staged && all_peers_direct);
    if (rows_move || blockIdx.x == 0) send_outputs(L, h, epoch, x, x_is_staged, all_peers_direct, layout_range, !rows_move, combine_shared);
    __syncthreads();
    reduce_outputs(L, h, epoch, a, false, combine_shared);
}

// ------------------------------------------------------------------ grids
// Small-block grid for `warps` warp items, within the thread budget of max_blocks full blocks (at least one block:
// the send kernels' last block signals even when there is nothing to move).
int small_grid(int64_t warps, int max_blocks) {
    return static_cast<int>(
        std::max<int64_t>(1, std::min<int64_t>(ceil_div<int64_t>(warps, kSmallWarps), int64_t(max_blocks) * kSmallPerFull)));
}
int send_grid(const Layout& L, int max_blocks, int num_tokens) {
    return small_grid(int64_t(num_tokens) * ceil_div(L.hidden, kStepChannels), max_blocks);
}
// Receivers size for the most messages the layout allows (the counts are only known on the device). One rank alone
// moves no message: a block per 16 unused-slot marks per thread.
int receive_grid(const Layout& L, int max_blocks) {
    const int64_t work = L.num_ranks == 1 ? ceil_div<int64_t>(int64_t(L.num_experts) * L.max_tokens, 16 * kThreads)
                                          : ceil_div<int64_t>(int64_t(L.num_experts) * L.max_tokens, kWarps);
    return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(max_blocks, work)));
}
int combine_send_grid(const Layout& L, int max_blocks) {
    return small_grid(int64_t(L.num_experts) * L.max_tokens * ceil_div<int64_t>(2 * int64_t(L.hidden), kChunkBytes), max_blocks);
}
int reduce_grid(const Layout& L, int max_blocks, int num_sms, int num_tokens) {
    const int64_t items = int64_t(num_tokens) * (L.hidden / 8);
    return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(std::min(num_sms, max_blocks), ceil_div<int64_t>(items, kThreads))));
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
    EP_HOST_ASSERT(prefix_shared_bytes(L) <= kMaxPrefixSharedBytes, "low-latency kernels support up to ",
                   kMaxPrefixSharedBytes / sizeof(int), " (local expert, rank) pairs, got ", num_experts / num_ranks, " x ", num_ranks);
    EP_HOST_ASSERT(plan_shared_bytes(L) <= kMaxPrefixSharedBytes, "low-latency kernels support up to ",
                   kMaxPrefixSharedBytes / (3 * sizeof(int)), " experts, got ", num_experts);
    L.dispatch_msg_bytes = align_up(kHeaderBytes + std::max<int64_t>(2 * hidden, hidden + hidden / kFp8GroupSize * 4), 16);
    const int64_t combine_msg_bytes = align_up(kHeaderBytes + 2 * int64_t(hidden), 16);
    const int64_t slots = int64_t(num_experts) * max_tokens;  // == E_local * R * T
    L.send_bytes = align_up(std::max(int64_t(max_tokens) * L.dispatch_msg_bytes, slots * combine_msg_bytes), kRegionAlignment);
    L.recv_bytes = align_up(slots * std::max(L.dispatch_msg_bytes, combine_msg_bytes), kRegionAlignment);
    L.signal_bytes = align_up(int64_t(num_experts) * 16 + int64_t(num_ranks) * 8, kRegionAlignment);
    L.half_bytes = L.send_bytes + L.recv_bytes + L.signal_bytes;
    return L;
}

namespace {

// The shared-memory opt-in past the default limit, made once per kernel and size (a cudaFuncSetAttribute per call
// costs host time on the hot path).
template <typename Kernel>
void allow_shared_bytes(Kernel kernel, size_t bytes) {
    if (bytes <= kMaxPrefixSharedBytes) return;
    static std::mutex mutex;
    static std::map<std::pair<int, const void*>, size_t> allowed;  // (device, kernel) -> bytes
    int device = 0;
    EP_CUDA_CHECK(cudaGetDevice(&device));
    const std::lock_guard<std::mutex> lock(mutex);
    size_t& done = allowed[{device, reinterpret_cast<const void*>(kernel)}];
    if (bytes <= done) return;
    EP_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)));
    done = bytes;
}

void check_send_items(const Layout& L, int num_tokens) {
    EP_HOST_ASSERT(int64_t(num_tokens) * ceil_div(L.hidden, kStepChannels) <= INT_MAX, "low-latency dispatch: ", num_tokens,
                   " tokens of hidden ", L.hidden, " are too many (the send counts (token, step) items in int32)");
}

}  // namespace

void dispatch_send(const Layout& L, const Half& h, const void* x, const int64_t* topk_idx, int num_tokens, int num_topk, bool use_fp8,
                   bool round_scale, bool all_peers_direct, int* send_slot, const DirectReceive& direct, cudaStream_t stream) {
    const ReceiveOutputs& o = direct.outputs;
    const bool outputs_given = o.recv_x != nullptr && o.src_info != nullptr && (!use_fp8 || o.recv_scales != nullptr);
    EP_HOST_ASSERT(L.num_ranks != 1 || outputs_given, "low-latency dispatch: one rank alone needs its receive outputs at the send");
    check_send_items(L, num_tokens);
    const int blocks = send_grid(L, h.max_blocks, num_tokens);
    const size_t shared = send_shared_bytes(L, num_tokens, num_topk, blocks);
    const auto kernel = use_fp8 ? (all_peers_direct ? send_tokens_kernel<true, false> : send_tokens_kernel<true, true>)
                                : (all_peers_direct ? send_tokens_kernel<false, false> : send_tokens_kernel<false, true>);
    allow_shared_bytes(kernel, shared);  // many tokens over few blocks
    const auto* xb = static_cast<const __nv_bfloat16*>(x);
    launch_kernel(chained_launch_for(L.num_ranks), kernel, blocks, kSmallThreads, shared, stream, L, h, xb, topk_idx, send_slot, num_tokens,
                  num_topk, round_scale, direct);
}

bool one_rank_fused(const Layout& L) { return L.num_ranks == 1 && pending_kernels_enabled(); }

void dispatch_recv(const Layout& L, const Half& h, bool use_fp8, bool use_ue8m0, const ReceiveOutputs& outputs, cudaStream_t stream) {
    if (one_rank_fused(L)) return;  // the send kernel received
    const size_t shared = prefix_shared_bytes(L);
    const dim3 grid(receive_grid(L, h.max_blocks));
    const auto kernel = !use_fp8 ? receive_tokens_kernel<false, false> : use_ue8m0 ? receive_tokens_kernel<true, true>
                                                                                   : receive_tokens_kernel<true, false>;
    launch_kernel(chained_launch_for(L.num_ranks), kernel, grid, kThreads, shared, stream, L, h, outputs);
}

bool dispatch_in_one_kernel(const Layout& L, const Half& h, const void* x, const int64_t* topk_idx, int num_tokens, int num_topk,
                            bool use_fp8, bool round_scale, bool use_ue8m0, bool all_peers_direct, int* send_slot,
                            const ReceiveOutputs& outputs, cudaStream_t stream) {
    if (L.num_ranks == 1 || !pending_kernels_enabled()) return false;
    check_send_items(L, num_tokens);
    // Small blocks: the send's grid, or the receive's threads, whichever is wider (both within the max_blocks budget).
    const int blocks = std::max(send_grid(L, h.max_blocks, num_tokens), receive_grid(L, h.max_blocks) * kSmallPerFull);
    const size_t shared = std::max(send_shared_bytes(L, num_tokens, num_topk, blocks), prefix_shared_bytes(L));
    const auto kernel = !use_fp8      ? (all_peers_direct ? send_and_receive_kernel<false, false, false> : send_and_receive_kernel<false, true, false>)
                        : !use_ue8m0 ? (all_peers_direct ? send_and_receive_kernel<true, false, false> : send_and_receive_kernel<true, true, false>)
                                     : (all_peers_direct ? send_and_receive_kernel<true, false, true> : send_and_receive_kernel<true, true, true>);
    allow_shared_bytes(kernel, shared);
    const DirectReceive unused{};  // more than one rank: the receive part places the rows
    launch_kernel(false, kernel, blocks, kSmallThreads, shared, stream, L, h, static_cast<const __nv_bfloat16*>(x), topk_idx, send_slot,
                  num_tokens, num_topk, round_scale, unused, outputs);
    return true;
}

void combine_send(const Layout& L, const Half& h, const void* x, bool x_is_staged, bool all_peers_direct, const int64_t* layout_range,
                  cudaStream_t stream) {
    if (x_is_staged && one_rank_fused(L)) return;  // the reduce reads the rows in place
    // Zero copy with every peer addressable: no row moves, one block waits for the acks and flags the sources.
    const int blocks = x_is_staged && all_peers_direct ? 1 : combine_send_grid(L, h.max_blocks);
    launch_kernel(chained_launch_for(L.num_ranks), send_outputs_kernel, blocks, kSmallThreads, prefix_shared_bytes(L), stream, L, h,
                  static_cast<const __nv_bfloat16*>(x), x_is_staged, all_peers_direct, layout_range);
}

void combine_recv(const Layout& L, const Half& h, const ReduceArgs& args, bool x_is_staged, int num_sms, cudaStream_t stream) {
    const bool rows_in_place = x_is_staged && one_rank_fused(L);
    launch_kernel(chained_launch_for(L.num_ranks), reduce_outputs_kernel, reduce_grid(L, h.max_blocks, num_sms, args.num_tokens), kThreads,
                  L.num_experts * sizeof(int), stream, L, h, args, rows_in_place);
}

bool combine_in_one_kernel(const Layout& L, const Half& h, const void* x, bool x_is_staged, bool all_peers_direct,
                           const int64_t* layout_range, const ReduceArgs& args, int num_sms, cudaStream_t stream) {
    if (L.num_ranks == 1 || !pending_kernels_enabled()) return false;
    const bool rows_move = !(x_is_staged && all_peers_direct);
    const int reduce_blocks = reduce_grid(L, h.max_blocks, num_sms, args.num_tokens) * kSmallPerFull;
    const int blocks = rows_move ? std::max(combine_send_grid(L, h.max_blocks), reduce_blocks) : reduce_blocks;
    const size_t shared = std::max(prefix_shared_bytes(L), L.num_experts * sizeof(int));
    launch_kernel(false, send_and_reduce_kernel, blocks, kSmallThreads, shared, stream, L, h, static_cast<const __nv_bfloat16*>(x), x_is_staged,
                  all_peers_direct, layout_range, args);
    return true;
}

int widest_grid_blocks(const Layout& L, int max_blocks, int num_tokens) {
    const int small = std::max(send_grid(L, max_blocks, num_tokens), combine_send_grid(L, max_blocks));
    return std::max({ceil_div(small, kSmallPerFull), receive_grid(L, max_blocks), reduce_grid(L, max_blocks, max_blocks, num_tokens)});
}

}  // namespace ep::low_latency
