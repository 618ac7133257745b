// Constants shared by every kernel family and its host launcher, one definition each, each with the reason for its
// value. A plain header (no CUDA or torch types): the host-only binding files include it too.
#pragma once

#include <cstdint>

namespace ep {

// ------------------------------------------------------------------ launch shapes
constexpr int kWarpSize = 32;
constexpr unsigned kFullWarpMask = 0xffffffffu;  // every lane of a warp takes part in a ballot / shuffle

// Threads per block for the bookkeeping kernels (layout, notify, barriers): 8 warps give each SM enough loads in
// flight to hide global-memory latency, while a block's shared counters and __syncthreads stay cheap.
constexpr int kNumThreadsPerBlock = 256;

// Threads per block of the intranode and internode data kernels: 16 warps, one warp per token or row, enough 16-byte
// loads in flight per SM for the copies.
constexpr int kDataThreadsPerBlock = 512;
constexpr int kDataWarpsPerBlock = kDataThreadsPerBlock / kWarpSize;

// ------------------------------------------------------------------ payload shapes
constexpr int kMaxTopk = 16;  // widest top-k (NUM_MAX_TOPK in ep_dispatcher/config.py): one warp lane per entry

// Every region of a communication buffer starts on a 128-byte boundary: 16-byte vectors, whole cache lines.
constexpr int64_t kRegionAlignment = 128;

// FP8 (E4M3) payloads, bit-exact with ep_dispatcher.fp8: each group of 128 channels shares one fp32 scale,
// scale = max(amax, kFp8AmaxFloor) / kFp8Max (true division).
constexpr int kFp8GroupSize = 128;
constexpr float kFp8Max = 448.0f;       // the largest finite E4M3 value
constexpr float kFp8AmaxFloor = 1e-4f;  // keeps an all-zero group's scale finite and nonzero (no division by zero)

// Element type of a combine's payload (the reduce kernels accumulate in fp32 either way); vec.cuh's
// with_float_type() turns it into a template argument.
enum class FloatType : int { kBFloat16 = 0, kFloat32 = 1 };

}  // namespace ep
