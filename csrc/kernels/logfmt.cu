// LogFMT-10 round trip, bit-exact with ep_dispatcher/logfmt.py.
//
// One warp per 128-channel group, four channels per lane. Everything is float64 and follows the reference operation
// by operation: the multiply-adds use __dmul_rn/__dadd_rn so nvcc cannot contract them into FMAs (the reference
// rounds each step), NaNs propagate through amax/amin as torch's amax/amin do, and the result is rounded to BF16 via
// float, as torch converts float64 to bfloat16. The only possible difference is a last-bit difference between CUDA's
// and libm's float64 log2/exp2 moving a value across a floor or a rounding boundary (about 1e-13 per element).
#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>

#include "kernels/constants.h"
#include "kernels/logfmt.cuh"

namespace ep {
namespace logfmt {
namespace {

constexpr int kPerLane = kGroupSize / kWarpSize;  // 4 channels per lane
constexpr int kWarpsPerBlock = 8;                 // 256 threads: enough blocks to fill the GPU for ~1e5 groups
constexpr double kMinClip = 32.0;                 // log2 range below amax that codes reach
constexpr double kLevels = 510.0;                 // 2^9 - 2 steps between amin and amax
constexpr double kMaxCode = 511.0;                // 9 magnitude bits
constexpr double kThreshold = 0.0;                // groups with log2(amax) >= 0 stay BF16

__device__ __forceinline__ double nan_max(double a, double b) { return (isnan(a) || a > b) ? a : b; }
__device__ __forceinline__ double nan_min(double a, double b) { return (isnan(a) || a < b) ? a : b; }

__global__ void roundtrip_kernel(const __nv_bfloat16* __restrict__ x, __nv_bfloat16* out, int64_t num_groups) {
    const int lane = threadIdx.x % kWarpSize;
    const int64_t warp = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / kWarpSize;
    const int64_t num_warps = static_cast<int64_t>(gridDim.x) * blockDim.x / kWarpSize;
    for (int64_t group = warp; group < num_groups; group += num_warps) {
        const int64_t base = group * kGroupSize + lane * kPerLane;
        double v[kPerLane];
        double amax = -INFINITY, amin = INFINITY;
#pragma unroll
        for (int i = 0; i < kPerLane; ++i) {
            v[i] = static_cast<double>(__bfloat162float(x[base + i]));
            const double a = fabs(v[i]);
            amax = nan_max(a, amax);
            amin = nan_min(a, amin);
        }
#pragma unroll
        for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
            amax = nan_max(__shfl_xor_sync(kFullWarpMask, amax, offset), amax);
            amin = nan_min(__shfl_xor_sync(kFullWarpMask, amin, offset), amin);
        }
        const double log_amax = log2(amax);
        const double clipped = log_amax - kMinClip;
        const double log_amin = amin == 0.0 ? clipped : fmax(log2(amin), clipped);
        const bool cast = log_amax < kThreshold && log_amin < log_amax;
        const double step = cast ? (log_amax - log_amin) / kLevels : 1.0;
        const double rounding = 2.0 - log2((1.0 + exp2(step)) * 0.5) / step;
#pragma unroll
        for (int i = 0; i < kPerLane; ++i) {
            double result = v[i];
            if (cast) {
                const double a = fabs(v[i]);
                const double scaled = __dadd_rn((log2(a) - log_amin) / step, rounding);
                const double code = fmin(floor(fmax(scaled, 0.0)), kMaxCode);
                const double magnitude = code == 0.0 ? 0.0 : exp2(__dadd_rn(__dmul_rn(code - 1.0, step), log_amin));
                result = signbit(v[i]) ? -magnitude : magnitude;
            }
            out[base + i] = __float2bfloat16_rn(static_cast<float>(result));
        }
    }
}

}  // namespace

void roundtrip(const void* x, void* out, int64_t num_groups, cudaStream_t stream) {
    if (num_groups <= 0) return;
    constexpr int64_t kMaxBlocks = 65535;  // grid-stride loop covers the rest
    const int64_t blocks = std::min<int64_t>((num_groups + kWarpsPerBlock - 1) / kWarpsPerBlock, kMaxBlocks);
    roundtrip_kernel<<<static_cast<unsigned>(blocks), kWarpsPerBlock * kWarpSize, 0, stream>>>(
        static_cast<const __nv_bfloat16*>(x), static_cast<__nv_bfloat16*>(out), num_groups);
}

}  // namespace logfmt
}  // namespace ep
