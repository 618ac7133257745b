// Argument checks shared by the Python bindings (C++ guards; the Python layer validates first).
#pragma once

#include <torch/extension.h>

namespace ep {

// `t` must be a contiguous tensor on CUDA device `device`.
inline void check_cuda_tensor(const at::Tensor& t, const char* name, int device) {
    TORCH_CHECK_VALUE(t.is_cuda() && t.get_device() == device, name, ": expected a tensor on cuda:", device, ", got ", t.device());
    TORCH_CHECK_VALUE(t.is_contiguous(), name, ": expected a contiguous tensor");
}

}  // namespace ep
