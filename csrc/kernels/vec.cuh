// 16-byte vectors of BF16 or fp32 elements as the combine kernels sum them (fp32 accumulation either way), the
// float-type dispatch of their launchers, and the per-token sum both high-throughput engines reduce with.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "constants.h"

namespace ep {

template <typename T>
struct Vec;
template <>
struct Vec<__nv_bfloat16> {
    static constexpr int kElems = 8;  // one 16-byte vector
    __device__ static float get(const int4& v, int i) { return __bfloat162float(reinterpret_cast<const __nv_bfloat16*>(&v)[i]); }
    __device__ static void set(int4& v, int i, float f) { reinterpret_cast<__nv_bfloat16*>(&v)[i] = __float2bfloat16_rn(f); }
};
template <>
struct Vec<float> {
    static constexpr int kElems = 4;
    __device__ static float get(const int4& v, int i) { return reinterpret_cast<const float*>(&v)[i]; }
    __device__ static void set(int4& v, int i, float f) { reinterpret_cast<float*>(&v)[i] = f; }
};

// Calls launch(T{}) with T the element type `type` names (__nv_bfloat16 or float): one place turns the host's
// FloatType into a kernel's template argument.
template <typename Launch>
void with_float_type(FloatType type, Launch&& launch) {
    if (type == FloatType::kBFloat16)
        launch(__nv_bfloat16{});
    else
        launch(float{});
}

// A lane sums kSumSpan vectors per pass (i, i + 32, ...) and issues the loads of kSumBatch rows for all of them before
// any is summed, so up to kSumSpan * kSumBatch loads overlap: with few rows per token (one, at EP = 1) a vector per
// pass would leave a warp with a single load in flight. The sum still runs in row order.
constexpr int kSumBatch = 2;
constexpr int kSumSpan = 4;

// One warp sums one token's rows, a 16-byte vector per lane step over `vectors` vectors:
//   out = bias0 + bias1 + row(0) + row(1) + ... + row(count - 1)
// in fp32, with __fadd_rn in exactly that order (the reference backend's), rounded once to T. A null bias is skipped.
// The order is what makes the engines bit-exact: plain adds (a sum has no multiply a compiler could fuse, and
// __fadd_rn is never reassociated). `row(j)` gives the j-th row's first vector; biases are read-only for the kernel.
template <typename T, typename Row>
__device__ __forceinline__ void sum_token_rows(const T* bias0, const T* bias1, int count, Row&& row, T* out, int vectors, int lane) {
    using V = Vec<T>;
    for (int i0 = lane; i0 < vectors; i0 += kWarpSize * kSumSpan) {
        float acc[kSumSpan][V::kElems];
        bool in_row[kSumSpan];
#pragma unroll
        for (int s = 0; s < kSumSpan; ++s) {
            in_row[s] = i0 + s * kWarpSize < vectors;
#pragma unroll
            for (int k = 0; k < V::kElems; ++k) acc[s][k] = 0.0f;
        }
        const T* const biases[2] = {bias0, bias1};
#pragma unroll
        for (const T* bias : biases) {
            if (bias == nullptr) continue;
#pragma unroll
            for (int s = 0; s < kSumSpan; ++s) {
                if (!in_row[s]) continue;
                const int4 b = __ldg(reinterpret_cast<const int4*>(bias) + i0 + s * kWarpSize);
#pragma unroll
                for (int k = 0; k < V::kElems; ++k) acc[s][k] = __fadd_rn(acc[s][k], V::get(b, k));
            }
        }
        for (int j0 = 0; j0 < count; j0 += kSumBatch) {
            int4 v[kSumBatch][kSumSpan];
#pragma unroll
            for (int u = 0; u < kSumBatch; ++u)
#pragma unroll
                for (int s = 0; s < kSumSpan; ++s)
                    if (j0 + u < count && in_row[s]) v[u][s] = row(j0 + u)[i0 + s * kWarpSize];
#pragma unroll
            for (int u = 0; u < kSumBatch; ++u) {
                if (j0 + u >= count) break;
#pragma unroll
                for (int s = 0; s < kSumSpan; ++s)
#pragma unroll
                    for (int k = 0; k < V::kElems; ++k) acc[s][k] = __fadd_rn(acc[s][k], V::get(v[u][s], k));
            }
        }
#pragma unroll
        for (int s = 0; s < kSumSpan; ++s) {
            if (!in_row[s]) continue;
            int4 o;
#pragma unroll
            for (int k = 0; k < V::kElems; ++k) V::set(o, k, acc[s][k]);
            reinterpret_cast<int4*>(out)[i0 + s * kWarpSize] = o;
        }
    }
}

// The top-k weights of the same token: lane k returns weight_row(0)[k] + weight_row(1)[k] + ..., fp32, in row order.
template <typename WeightRow>
__device__ __forceinline__ float sum_token_weights(int count, WeightRow&& weight_row, int lane) {
    float acc = 0.0f;
    for (int j = 0; j < count; ++j) acc = __fadd_rn(acc, weight_row(j)[lane]);
    return acc;
}

}  // namespace ep
