// Warp-cooperative primitives: copies of 16-byte vectors that keep several loads in flight per lane, and the ballot
// compaction that lists a token's destinations.
//
// A loop that stores each vector before it loads the next waits one full memory latency (HBM or a peer's
// memory, ~0.5-1 µs) per 512 bytes per warp, because the store needs the loaded value and the next load may
// alias the store. Loading kCopyBatch vectors into registers first and storing them afterwards overlaps those
// latencies: a 7 KB row then costs two round trips instead of fourteen.
#pragma once

#include <cstdint>

#include "constants.h"

namespace ep {

constexpr int kCopyBatch = 8;  // vectors per lane in flight: 8 x 16 B x 32 lanes = 4 KB per warp
constexpr int kCopyLanes = kWarpSize;

// For vectors i = lane, lane + 32, ... < n: store(i, load(i)), kCopyBatch loads per lane issued before their stores.
// `load(i) -> int4` and `store(i, int4)` are device lambdas (or functors), so each caller picks its load flavour
// (ld.global.nc, ld.global.cg) and its destinations (one, several, a peer's mapping).
template <typename Load, typename Store>
__device__ __forceinline__ void warp_copy_batched(int64_t n, int lane, Load&& load, Store&& store) {
    for (int64_t base = lane; base < n; base += static_cast<int64_t>(kCopyBatch) * kCopyLanes) {
        int4 v[kCopyBatch];
#pragma unroll
        for (int u = 0; u < kCopyBatch; ++u)
            if (base + u * kCopyLanes < n) v[u] = load(base + u * kCopyLanes);
#pragma unroll
        for (int u = 0; u < kCopyBatch; ++u)
            if (base + u * kCopyLanes < n) store(base + u * kCopyLanes, v[u]);
    }
}

// How warp_copy loads its source. kReadOnly: through the non-coherent read-only path (__ldg), for a source nobody
// writes while the kernel runs; kPlain: ordinary global loads.
enum class CopySource { kReadOnly, kPlain };

// Copies `bytes` from src to dst with one warp: batched 16-byte vectors when both ends and the size allow, else 4-byte
// words (FP8 scale rows are multiples of 4 bytes), else bytes (plain loads).
template <CopySource kSource>
__device__ __forceinline__ void warp_copy(void* dst, const void* src, int64_t bytes, int lane) {
    const auto misalignment = reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src) | static_cast<uintptr_t>(bytes);
    if ((misalignment & 15) == 0) {
        auto* d = static_cast<int4*>(dst);
        const auto* s = static_cast<const int4*>(src);
        if constexpr (kSource == CopySource::kReadOnly)
            warp_copy_batched(bytes / 16, lane, [&](int64_t i) { return __ldg(s + i); }, [&](int64_t i, const int4& v) { d[i] = v; });
        else
            warp_copy_batched(bytes / 16, lane, [&](int64_t i) { return s[i]; }, [&](int64_t i, const int4& v) { d[i] = v; });
    } else if ((misalignment & 3) == 0) {
        auto* d = static_cast<int*>(dst);
        const auto* s = static_cast<const int*>(src);
        for (int64_t i = lane; i < bytes / 4; i += kWarpSize) {
            if constexpr (kSource == CopySource::kReadOnly)
                d[i] = __ldg(s + i);
            else
                d[i] = s[i];
        }
    } else {
        auto* d = static_cast<char*>(dst);
        const auto* s = static_cast<const char*>(src);
        for (int64_t i = lane; i < bytes; i += kWarpSize) d[i] = s[i];
    }
}

// Copies one row of `bytes` at src to `count` rows dst(j), j < count, with one warp: each 16-byte vector is read once
// (read-only path) and stored to every destination (a dispatched token's rows at several ranks or experts). Rows whose
// size is not a multiple of 16 bytes go one destination at a time through warp_copy.
template <typename Dst>
__device__ __forceinline__ void warp_copy_to_each(const char* src, int64_t bytes, int count, Dst&& dst, int lane) {
    if ((bytes & 15) == 0) {
        const int4* s = reinterpret_cast<const int4*>(src);
        warp_copy_batched(
            bytes / 16, lane, [&](int64_t i) { return __ldg(s + i); },
            [&](int64_t i, const int4& v) {
                for (int j = 0; j < count; ++j) reinterpret_cast<int4*>(dst(j))[i] = v;
            });
    } else {
        for (int j = 0; j < count; ++j) warp_copy<CopySource::kReadOnly>(dst(j), src, bytes, lane);
    }
}

// Numbers, in ascending order, the indices i < n for which hit(i) holds: visit(i, slot) runs on the lane that tested
// i, with slot = how many hits precede i. Returns the number of hits (the same on every lane). Run by a whole warp;
// a hit's visit runs before the next 32 indices are tested.
template <typename Hit, typename Visit>
__device__ __forceinline__ int warp_compact(int n, int lane, Hit&& hit, Visit&& visit) {
    int count = 0;
    for (int base = 0; base < n; base += kWarpSize) {
        const int i = base + lane;
        const bool is_hit = i < n && hit(i);
        const unsigned mask = __ballot_sync(kFullWarpMask, is_hit);
        if (is_hit) visit(i, count + __popc(mask & ((1u << lane) - 1)));
        count += __popc(mask);
    }
    return count;
}

}  // namespace ep
