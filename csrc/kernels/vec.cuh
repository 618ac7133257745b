// 16-byte vectors of BF16 or fp32 elements as the combine kernels sum them (fp32 accumulation either way).
#pragma once

#include <cuda_bf16.h>

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

}  // namespace ep
