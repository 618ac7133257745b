// Include before anything else in a .cu that calls NVSHMEM's device API.
//
// torch's extension build defines these for every nvcc compile; NVSHMEM's device headers need the half/bf16
// operators they switch off (its reductions over half), so a file that includes them turns them back on.
#pragma once

#undef __CUDA_NO_HALF_OPERATORS__
#undef __CUDA_NO_HALF_CONVERSIONS__
#undef __CUDA_NO_HALF2_OPERATORS__
#undef __CUDA_NO_BFLOAT16_CONVERSIONS__
#undef __CUDA_NO_BFLOAT16_OPERATORS__
#undef __CUDA_NO_BFLOAT162_OPERATORS__

#include <cuda_bf16.h>

#ifdef EP_DISPATCHER_WITH_NVSHMEM
#include <nvshmem.h>
#include <nvshmemx.h>
#endif
