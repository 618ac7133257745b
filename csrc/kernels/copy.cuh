// Warp-cooperative copies of 16-byte vectors that keep several loads in flight per lane.
//
// A loop that stores each vector before it loads the next waits one full memory latency (HBM or a peer's
// memory, ~0.5-1 µs) per 512 bytes per warp, because the store needs the loaded value and the next load may
// alias the store. Loading kCopyBatch vectors into registers first and storing them afterwards overlaps those
// latencies: a 7 KB row then costs two round trips instead of fourteen.
#pragma once

#include <cstdint>

namespace ep {

constexpr int kCopyBatch = 8;  // vectors per lane in flight: 8 x 16 B x 32 lanes = 4 KB per warp
constexpr int kCopyLanes = 32;

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

}  // namespace ep
