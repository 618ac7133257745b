// Argument checks shared by the Python bindings (C++ guards; the Python layer validates first).
#pragma once

#include <torch/extension.h>

#include <optional>

#include "kernels/constants.h"

namespace ep {

using OptTensor = std::optional<at::Tensor>;

// `t` must be a contiguous tensor on CUDA device `device`.
inline void check_cuda_tensor(const at::Tensor& t, const char* name, int device) {
    TORCH_CHECK_VALUE(t.is_cuda() && t.get_device() == device, name, ": expected a tensor on cuda:", device, ", got ", t.device());
    TORCH_CHECK_VALUE(t.is_contiguous(), name, ": expected a contiguous tensor");
}

// The kernels' element type of a combine payload: BF16, else fp32 (the Python layer routes every other dtype to the
// reference backend).
inline FloatType float_type_of(const at::Tensor& x) {
    return x.scalar_type() == at::kBFloat16 ? FloatType::kBFloat16 : FloatType::kFloat32;
}

}  // namespace ep
