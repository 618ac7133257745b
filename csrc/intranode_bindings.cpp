// Python bindings of the intranode engine (ep_dispatcher._C.IpcBuffer, intranode_*). Internal: ep_dispatcher's
// CudaBackend validates arguments and owns the call sequence; the checks here guard the C++ side only.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/extension.h>

#include <optional>
#include <tuple>

#include "binding_checks.h"
#include "kernels/intranode.cuh"
#include "runtime/ipc_buffer.h"

namespace py = pybind11;

namespace ep {
namespace {

using OptTensor = std::optional<at::Tensor>;

void check_cuda(const at::Tensor& t, const char* name, const IpcBuffer& buffer) {
    check_cuda_tensor(t, name, buffer.device());
}

std::tuple<at::Tensor, OptTensor> notify(IpcBuffer& buffer, const at::Tensor& num_tokens_per_rank, const OptTensor& num_tokens_per_expert,
                                         int64_t num_experts, int64_t expert_alignment, int64_t timeout_ns) {
    TORCH_CHECK(buffer.is_open(), "intranode_notify: peers are not mapped");
    check_cuda(num_tokens_per_rank, "num_tokens_per_rank", buffer);
    const c10::cuda::CUDAGuard guard(num_tokens_per_rank.device());
    const int R = buffer.num_ranks();
    auto options = num_tokens_per_rank.options().dtype(at::kInt);
    at::Tensor count_matrix = at::empty({R, R}, options);
    OptTensor recv_per_expert;
    if (num_tokens_per_expert) {
        check_cuda(*num_tokens_per_expert, "num_tokens_per_expert", buffer);
        recv_per_expert = at::empty({num_experts / R}, options);
    }
    intranode::notify(buffer.peers(), buffer.rank(), R, buffer.epoch(), num_tokens_per_rank.data_ptr<int>(),
                      num_tokens_per_expert ? num_tokens_per_expert->data_ptr<int>() : nullptr, static_cast<int>(num_experts),
                      static_cast<int>(expert_alignment), count_matrix.data_ptr<int>(),
                      recv_per_expert ? recv_per_expert->data_ptr<int>() : nullptr, timeout_ns, c10::cuda::getCurrentCUDAStream());
    return {count_matrix, recv_per_expert};
}

std::tuple<at::Tensor, OptTensor, OptTensor, OptTensor, at::Tensor> dispatch(
    IpcBuffer& buffer, const at::Tensor& x, const OptTensor& scales, const OptTensor& topk_idx, const OptTensor& topk_weights,
    int64_t num_local_experts, const at::Tensor& is_token_in_rank, const at::Tensor& send_pos, const at::Tensor& count_matrix,
    int64_t rows_out, int64_t num_sms, int64_t timeout_ns, bool sync_before) {
    TORCH_CHECK(buffer.is_open(), "intranode_dispatch: peers are not mapped");
    for (const auto& [t, name] : {std::pair{&x, "x"}, {&is_token_in_rank, "is_token_in_rank"}, {&send_pos, "send_pos"},
                                  {&count_matrix, "count_matrix"}})
        check_cuda(*t, name, buffer);
    TORCH_CHECK_VALUE(x.dim() == 2, "x: expected [num_tokens, hidden]");
    const c10::cuda::CUDAGuard guard(x.device());
    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
    const int R = buffer.num_ranks();
    const int num_tokens = static_cast<int>(x.size(0));
    const int x_row = static_cast<int>(x.size(1) * x.element_size());
    const int scale_row = scales ? static_cast<int>(scales->size(1) * scales->element_size()) : 0;
    const int num_topk = topk_idx ? static_cast<int>(topk_idx->size(1)) : 0;
    if (scales) check_cuda(*scales, "scales", buffer);
    if (topk_idx) {
        check_cuda(*topk_idx, "topk_idx", buffer);
        TORCH_CHECK_VALUE(topk_weights.has_value(), "topk_weights: required with topk_idx");
        check_cuda(*topk_weights, "topk_weights", buffer);
    }
    const auto regions = intranode::dispatch_regions(buffer.data_bytes(), x_row, scale_row, num_topk);
    TORCH_CHECK_VALUE(rows_out <= regions.capacity, "num_nvl_bytes: the buffer holds ", regions.capacity,
                      " received rows of this shape, this dispatch needs ", rows_out);

    // Everyone's previous use of its data area is over once all ranks pass this point (stream order). A fresh
    // dispatch skips it: its notify step already synchronised all ranks after their previous work.
    if (sync_before) intranode::barrier(buffer.peers(), buffer.rank(), R, buffer.epoch(), timeout_ns, 2, stream);
    intranode::dispatch(buffer.peers(), buffer.rank(), R, x.data_ptr(), x_row, scales ? scales->data_ptr() : nullptr, scale_row,
                        topk_idx ? topk_idx->data_ptr<int64_t>() : nullptr, topk_weights ? topk_weights->data_ptr<float>() : nullptr,
                        num_topk, static_cast<int>(num_local_experts), is_token_in_rank.data_ptr<bool>(), send_pos.data_ptr<int>(),
                        count_matrix.data_ptr<int>(), num_tokens, regions, static_cast<int>(num_sms), stream);
    intranode::barrier(buffer.peers(), buffer.rank(), R, buffer.epoch(), timeout_ns, 2, stream);

    at::Tensor recv_x = at::empty({rows_out, x.size(1)}, x.options());
    OptTensor recv_scales, recv_topk, recv_weights;
    if (scales) recv_scales = at::empty({rows_out, scales->size(1)}, scales->options());
    if (topk_idx) {
        recv_topk = at::empty({rows_out, num_topk}, topk_idx->options());
        recv_weights = at::empty({rows_out, num_topk}, topk_weights->options());
    }
    at::Tensor recv_src = at::empty({rows_out}, x.options().dtype(at::kInt));
    intranode::copy_out(buffer.local_data(), regions, count_matrix.data_ptr<int>(), buffer.rank(), R, static_cast<int>(rows_out),
                        recv_x.data_ptr(), x_row, recv_scales ? recv_scales->data_ptr() : nullptr, scale_row,
                        recv_topk ? recv_topk->data_ptr<int64_t>() : nullptr, recv_weights ? recv_weights->data_ptr<float>() : nullptr,
                        num_topk, recv_src.data_ptr<int>(), static_cast<int>(num_sms), stream);
    return {recv_x, recv_scales, recv_topk, recv_weights, recv_src};
}

std::tuple<at::Tensor, OptTensor> combine(IpcBuffer& buffer, const at::Tensor& x, const OptTensor& topk_weights, const OptTensor& bias0,
                                          const OptTensor& bias1, const at::Tensor& is_token_in_rank, const at::Tensor& send_pos,
                                          const at::Tensor& count_matrix, int64_t num_tokens, int64_t num_sms, int64_t timeout_ns) {
    TORCH_CHECK(buffer.is_open(), "intranode_combine: peers are not mapped");
    for (const auto& [t, name] : {std::pair{&x, "x"}, {&is_token_in_rank, "is_token_in_rank"}, {&send_pos, "send_pos"},
                                  {&count_matrix, "count_matrix"}})
        check_cuda(*t, name, buffer);
    TORCH_CHECK_VALUE(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat, "x: expected bfloat16 or float32, got ",
                      x.scalar_type());
    const c10::cuda::CUDAGuard guard(x.device());
    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
    const int R = buffer.num_ranks();
    const int hidden = static_cast<int>(x.size(1));
    const int x_row = static_cast<int>(hidden * x.element_size());
    const int num_topk = topk_weights ? static_cast<int>(topk_weights->size(1)) : 0;
    if (topk_weights) check_cuda(*topk_weights, "topk_weights", buffer);
    for (const auto* b : {&bias0, &bias1})
        if (b->has_value()) check_cuda(**b, "bias", buffer);
    const auto regions = intranode::combine_regions(buffer.data_bytes(), x_row, num_topk);

    intranode::barrier(buffer.peers(), buffer.rank(), R, buffer.epoch(), timeout_ns, 3, stream);
    intranode::combine_send(buffer.peers(), buffer.rank(), R, x.data_ptr(), x_row, topk_weights ? topk_weights->data_ptr<float>() : nullptr,
                            num_topk, count_matrix.data_ptr<int>(), regions, static_cast<int>(num_sms), stream);
    intranode::barrier(buffer.peers(), buffer.rank(), R, buffer.epoch(), timeout_ns, 4, stream);

    at::Tensor out = at::empty({num_tokens, hidden}, x.options());
    OptTensor out_weights;
    if (topk_weights) out_weights = at::empty({num_tokens, num_topk}, topk_weights->options());
    intranode::combine_reduce(buffer.local_data(), regions, buffer.rank(), R, count_matrix.data_ptr<int>(), is_token_in_rank.data_ptr<bool>(),
                              send_pos.data_ptr<int>(), static_cast<int>(num_tokens), hidden,
                              x.scalar_type() == at::kBFloat16 ? intranode::FloatType::kBFloat16 : intranode::FloatType::kFloat32,
                              bias0 ? bias0->data_ptr() : nullptr, bias1 ? bias1->data_ptr() : nullptr, out.data_ptr(),
                              out_weights ? out_weights->data_ptr<float>() : nullptr, num_topk, static_cast<int>(num_sms), stream);
    return {out, out_weights};
}

}  // namespace

void register_intranode(py::module_& m) {
    py::class_<IpcBuffer>(m, "IpcBuffer", "One rank's CUDA-IPC buffer (signal area + data area) and its peers' mappings.")
        .def(py::init<int, int, int64_t, int>(), py::arg("rank"), py::arg("num_ranks"), py::arg("num_data_bytes"), py::arg("device"))
        .def("ipc_handle", [](const IpcBuffer& b) { return py::bytes(b.ipc_handle()); })
        .def("open_peers", [](IpcBuffer& b, const std::vector<py::bytes>& handles) {
            std::vector<std::string> raw(handles.begin(), handles.end());
            b.open_peers(raw);
        })
        .def("destroy", &IpcBuffer::destroy)
        .def_property_readonly("data_bytes", &IpcBuffer::data_bytes)
        .def("dispatch_capacity",
             [](const IpcBuffer& b, int x_row_bytes, int scale_row_bytes, int num_topk) {
                 return intranode::dispatch_regions(b.data_bytes(), x_row_bytes, scale_row_bytes, num_topk).capacity;
             })
        .def("combine_capacity", [](const IpcBuffer& b, int x_row_bytes, int num_topk) {
            return intranode::combine_regions(b.data_bytes(), x_row_bytes, num_topk).capacity;
        });
    m.attr("INTRANODE_SIGNAL_BYTES") = static_cast<int64_t>(intranode::kSignalBytes);
    m.attr("INTRANODE_MAX_RANKS") = intranode::kMaxRanks;
    m.attr("INTRANODE_MAX_EXPERTS") = intranode::kMaxExperts;
    m.def("intranode_notify", &notify, py::call_guard<py::gil_scoped_release>());
    m.def("intranode_dispatch", &dispatch, py::call_guard<py::gil_scoped_release>());
    m.def("intranode_combine", &combine, py::call_guard<py::gil_scoped_release>());
}

}  // namespace ep
