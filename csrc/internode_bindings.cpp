// Python bindings of the internode engine (ep_dispatcher._C.InternodeBuffer). Internal: ep_dispatcher's CudaBackend
// validates arguments and owns the call sequence; the checks here guard the C++ side only.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/extension.h>

#include <optional>
#include <tuple>
#include <vector>

#include "kernels/common.cuh"
#include "kernels/internode.cuh"
#include "kernels/intranode.cuh"
#include "binding_checks.h"
#include "runtime/nvshmem_runtime.h"
#include "runtime/timeout_record.h"

namespace py = pybind11;

namespace ep {
namespace {

// One rank's NVSHMEM buffer for internode high-throughput calls, its node peers' mappings and the epochs.
class InternodeBuffer {
   public:
    InternodeBuffer(int rank, int num_ranks, int num_ranks_per_node, int64_t num_bytes, int64_t timeout_ns, int device)
        : num_bytes_(num_bytes), device_(device) {
        TORCH_CHECK_VALUE(num_ranks_per_node > 0 && num_ranks % num_ranks_per_node == 0 && num_ranks > num_ranks_per_node,
                          "num_ranks_per_node: the internode engine needs several nodes of num_ranks_per_node ranks, got num_ranks=",
                          num_ranks, ", num_ranks_per_node=", num_ranks_per_node);
        TORCH_CHECK_VALUE(num_ranks <= internode::kMaxRanks, "num_ranks: the internode engine supports up to ", internode::kMaxRanks,
                          " ranks, got ", num_ranks);
        TORCH_CHECK_VALUE(num_ranks_per_node <= internode::kMaxRanksPerNode, "num_ranks_per_node: the internode engine supports up to ",
                          internode::kMaxRanksPerNode, " ranks per node, got ", num_ranks_per_node);
        const auto zero = internode::make_layout(16, num_ranks, num_ranks_per_node, 0);
        TORCH_CHECK_VALUE(num_bytes >= zero.total_bytes, "num_rdma_bytes: the internode engine needs at least ", zero.total_bytes,
                          " bytes, got ", num_bytes);
        const c10::cuda::CUDAGuard guard(device);
        sync::install_timeout_record(device);
        base_ = static_cast<uint8_t*>(nvshmem_runtime::alloc(num_bytes));
        ctx_.local = base_;
        ctx_.rank = rank;
        ctx_.num_ranks = num_ranks;
        ctx_.per_node = num_ranks_per_node;
        ctx_.num_nodes = num_ranks / num_ranks_per_node;
        ctx_.node = rank / num_ranks_per_node;
        ctx_.local_rank = rank % num_ranks_per_node;
        ctx_.timeout_ns = timeout_ns;
        // Only node peers are mapped: cross-node bytes always go through NVSHMEM puts, even where a mapping exists
        // (on one GPU every PE is reachable, and the put path must still be the one exercised).
        for (int j = 0; j < num_ranks_per_node; ++j) {
            const int pe = ctx_.node * num_ranks_per_node + j;
            const int64_t peer = nvshmem_runtime::peer_pointer(base_, pe);
            if (peer == 0) {
                // The allocation is left in place: freeing it is collective, and peers on other nodes may not fail here.
                base_ = nullptr;
                TORCH_CHECK(false, "internode engine: rank ", rank, " cannot map node peer ", pe,
                            " (nvshmem_ptr returned null): ranks of one node must be NVLink/P2P reachable; check num_ranks_per_node");
            }
            ctx_.peer[j] = reinterpret_cast<uint8_t*>(peer);
        }
        EP_CUDA_CHECK(cudaMalloc(&state_, sizeof(internode::State)));
        EP_CUDA_CHECK(cudaMemset(state_, 0, sizeof(internode::State)));
        ctx_.state = state_;
    }

    // Tokens per rank the buffer holds for rows of hidden_bytes (= hidden * max(element_size, 2)).
    int max_tokens(int64_t hidden_bytes) const {
        return internode::max_tokens_for(num_bytes_, hidden_bytes, ctx_.num_ranks, ctx_.per_node);
    }

    std::tuple<at::Tensor, at::Tensor, at::Tensor, OptTensor> notify(const at::Tensor& per_rank, const at::Tensor& per_node,
                                                                     int64_t num_tokens, const OptTensor& per_expert, int64_t num_experts,
                                                                     int64_t expert_alignment) {
        check(per_rank, "num_tokens_per_rank");
        check(per_node, "num_tokens_per_node");
        if (per_expert) check(*per_expert, "num_tokens_per_expert");
        const c10::cuda::CUDAGuard guard(device_);
        const int R = ctx_.num_ranks, N = ctx_.num_nodes;
        const auto options = per_rank.options().dtype(at::kInt);
        at::Tensor count_matrix = at::empty({R, R}, options);
        at::Tensor node_count = at::empty({R, N}, options);
        at::Tensor tokens_of = at::empty({R}, options);
        OptTensor recv_per_expert;
        if (per_expert) {
            TORCH_CHECK_VALUE(num_experts / R <= internode::kMaxLocalExperts, "num_experts: the internode engine supports up to ",
                              internode::kMaxLocalExperts, " experts per rank, got ", num_experts / R);
            recv_per_expert = at::empty({num_experts / R}, options);
        }
        const auto L = internode::make_layout(16, R, ctx_.per_node, 0);  // the signal part does not depend on the shape
        internode::notify(L, ctx(), per_rank.data_ptr<int>(), per_node.data_ptr<int>(), static_cast<int>(num_tokens),
                          per_expert ? per_expert->data_ptr<int>() : nullptr, static_cast<int>(num_experts),
                          static_cast<int>(expert_alignment), count_matrix.data_ptr<int>(), node_count.data_ptr<int>(),
                          tokens_of.data_ptr<int>(), recv_per_expert ? recv_per_expert->data_ptr<int>() : nullptr, stream());
        return {count_matrix, node_count, tokens_of, recv_per_expert};
    }

    std::tuple<at::Tensor, OptTensor, OptTensor, OptTensor, at::Tensor, OptTensor> dispatch(
        const at::Tensor& x, const OptTensor& scales, const OptTensor& topk_idx, const OptTensor& topk_weights, int64_t num_local_experts,
        const at::Tensor& send_pos, const at::Tensor& rdma_send_pos, const at::Tensor& count_matrix, const at::Tensor& node_count,
        int64_t rows_out, int64_t hidden_bytes, int64_t num_sms, bool cached) {
        for (const auto& [t, name] : {std::pair{&x, "x"}, {&send_pos, "send_pos"}, {&rdma_send_pos, "rdma_send_pos"},
                                      {&count_matrix, "count_matrix"}, {&node_count, "node_count"}})
            check(*t, name);
        if (scales) check(*scales, "scales");
        if (topk_idx) {
            check(*topk_idx, "topk_idx");
            TORCH_CHECK_VALUE(topk_weights.has_value(), "topk_weights: required with topk_idx");
            check(*topk_weights, "topk_weights");
        }
        const c10::cuda::CUDAGuard guard(device_);
        const int R = ctx_.num_ranks, P = ctx_.per_node, N = ctx_.num_nodes;
        const int num_tokens = static_cast<int>(x.size(0));
        const int x_row = static_cast<int>(x.size(1) * x.element_size());
        const int scale_row = scales ? static_cast<int>(scales->size(1) * scales->element_size()) : 0;
        const int num_topk = topk_idx ? static_cast<int>(topk_idx->size(1)) : 0;
        const auto L = layout(hidden_bytes);
        const auto F = internode::make_fields(L, x_row, scale_row, num_topk);
        const auto regions = intranode::dispatch_regions(static_cast<size_t>(L.recv_bytes), x_row, scale_row, num_topk);
        TORCH_CHECK_VALUE(rows_out <= regions.capacity, "num_worst_tokens: the buffer holds ", regions.capacity,
                          " received rows of this shape, this dispatch asks for ", rows_out, "; raise num_rdma_bytes");
        const cudaStream_t s = stream();
        OptTensor fwd_pos;
        if (!cached) fwd_pos = at::empty({N, std::max(L.max_tokens, 1), P}, x.options().dtype(at::kInt));
        if (cached) internode::cached_dispatch_start(L, ctx(), s);
        internode::dispatch(L, ctx(), F, x.data_ptr(), scales ? scales->data_ptr() : nullptr,
                            topk_idx ? topk_idx->data_ptr<int64_t>() : nullptr, topk_weights ? topk_weights->data_ptr<float>() : nullptr,
                            static_cast<int>(num_local_experts), send_pos.data_ptr<int>(), rdma_send_pos.data_ptr<int>(),
                            count_matrix.data_ptr<int>(), node_count.data_ptr<int>(), num_tokens,
                            fwd_pos ? fwd_pos->data_ptr<int>() : nullptr, std::max(L.max_tokens, 1), regions.capacity, regions.x_offset,
                            regions.scales_offset, regions.topk_offset, regions.weights_offset, regions.src_offset,
                            static_cast<int>(num_sms), s);

        at::Tensor recv_x = at::empty({rows_out, x.size(1)}, x.options());
        OptTensor recv_scales, recv_topk, recv_weights;
        if (scales) recv_scales = at::empty({rows_out, scales->size(1)}, scales->options());
        if (topk_idx) {
            recv_topk = at::empty({rows_out, num_topk}, topk_idx->options());
            recv_weights = at::empty({rows_out, num_topk}, topk_weights->options());
        }
        at::Tensor recv_src = at::empty({rows_out}, x.options().dtype(at::kInt));
        intranode::copy_out(reinterpret_cast<const char*>(base_ + L.recv_offset), regions, count_matrix.data_ptr<int>(), ctx_.rank, R,
                            static_cast<int>(rows_out), recv_x.data_ptr(), x_row, recv_scales ? recv_scales->data_ptr() : nullptr,
                            scale_row, recv_topk ? recv_topk->data_ptr<int64_t>() : nullptr,
                            recv_weights ? recv_weights->data_ptr<float>() : nullptr, num_topk, recv_src.data_ptr<int>(),
                            static_cast<int>(num_sms), s);
        return {recv_x, recv_scales, recv_topk, recv_weights, recv_src, fwd_pos};
    }

    std::tuple<at::Tensor, OptTensor> combine(const at::Tensor& x, const OptTensor& topk_weights, const OptTensor& bias0,
                                              const OptTensor& bias1, const at::Tensor& rdma_send_pos, const at::Tensor& count_matrix,
                                              const at::Tensor& node_count, const at::Tensor& fwd_pos, int64_t num_tokens,
                                              int64_t hidden_bytes, int64_t num_sms) {
        for (const auto& [t, name] : {std::pair{&x, "x"}, {&rdma_send_pos, "rdma_send_pos"}, {&count_matrix, "count_matrix"},
                                      {&node_count, "node_count"}, {&fwd_pos, "fwd_pos"}})
            check(*t, name);
        TORCH_CHECK_VALUE(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat, "x: expected bfloat16 or float32, got ",
                          x.scalar_type());
        if (topk_weights) check(*topk_weights, "topk_weights");
        for (const auto* b : {&bias0, &bias1})
            if (b->has_value()) check(**b, "bias");
        const c10::cuda::CUDAGuard guard(device_);
        const int hidden = static_cast<int>(x.size(1));
        const int x_row = static_cast<int>(hidden * x.element_size());
        const int num_topk = topk_weights ? static_cast<int>(topk_weights->size(1)) : 0;
        const auto L = layout(hidden_bytes);
        const auto F = internode::make_fields(L, x_row, 0, num_topk);
        at::Tensor out = at::empty({num_tokens, hidden}, x.options());
        OptTensor out_weights;
        if (topk_weights) out_weights = at::empty({num_tokens, num_topk}, topk_weights->options());
        internode::combine(L, ctx(), F, float_type_of(x), x.data_ptr(), topk_weights ? topk_weights->data_ptr<float>() : nullptr,
                           bias0 ? bias0->data_ptr() : nullptr, bias1 ? bias1->data_ptr() : nullptr, rdma_send_pos.data_ptr<int>(),
                           count_matrix.data_ptr<int>(), node_count.data_ptr<int>(), fwd_pos.data_ptr<int>(),
                           static_cast<int>(fwd_pos.size(1)), static_cast<int>(num_tokens), out.data_ptr(),
                           out_weights ? out_weights->data_ptr<float>() : nullptr, static_cast<int>(num_sms), stream());
        return {out, out_weights};
    }

    // Collective (nvshmem_free).
    void destroy() {
        const c10::cuda::CUDAGuard guard(device_);
        if (!nvshmem_runtime::sync_and_free(base_)) return;
        cudaFree(state_);
        state_ = nullptr;
    }

   private:
    // The layout of the calls of hidden_bytes rows. Whether num_tokens fit is checked once, by the caller
    // (InternodeEngine._check_tokens, which knows every rank's count after the count exchange); the kernels' row-bound
    // traps are the last guard against writing past the buffer.
    internode::Layout layout(int64_t hidden_bytes) const {
        TORCH_CHECK(base_ != nullptr, "internode buffer was destroyed");
        return internode::make_layout(hidden_bytes, ctx_.num_ranks, ctx_.per_node, max_tokens(hidden_bytes));
    }
    const internode::Ctx& ctx() const {
        TORCH_CHECK(base_ != nullptr, "internode buffer was destroyed");
        return ctx_;
    }
    void check(const at::Tensor& t, const char* name) const {
        check_cuda_tensor(t, name, device_);
    }
    cudaStream_t stream() const { return c10::cuda::getCurrentCUDAStream(device_); }

    int64_t num_bytes_;
    int device_;
    uint8_t* base_ = nullptr;
    internode::State* state_ = nullptr;
    internode::Ctx ctx_{};
};

// The layout as Python sees it: a type of this file's anonymous namespace, so that its pybind11 class has the
// module's hidden visibility (binding ep::internode::Layout itself makes GCC warn about the visibility).
struct InternodeLayout : internode::Layout {};

}  // namespace

void register_internode(py::module_& m) {
    py::class_<InternodeBuffer>(m, "InternodeBuffer", "One rank's NVSHMEM buffer for internode high-throughput dispatch/combine.")
        .def(py::init<int, int, int, int64_t, int64_t, int>(), py::arg("rank"), py::arg("num_ranks"), py::arg("num_ranks_per_node"),
             py::arg("num_bytes"), py::arg("timeout_ns"), py::arg("device"))
        .def("max_tokens", &InternodeBuffer::max_tokens, py::arg("hidden_bytes"))
        .def("notify", &InternodeBuffer::notify, py::arg("per_rank"), py::arg("per_node"), py::arg("num_tokens"), py::arg("per_expert"),
             py::arg("num_experts"), py::arg("expert_alignment"), py::call_guard<py::gil_scoped_release>())
        .def("dispatch", &InternodeBuffer::dispatch, py::arg("x"), py::arg("scales"), py::arg("topk_idx"), py::arg("topk_weights"),
             py::arg("num_local_experts"), py::arg("send_pos"), py::arg("rdma_send_pos"), py::arg("count_matrix"), py::arg("node_count"),
             py::arg("rows_out"), py::arg("hidden_bytes"), py::arg("num_sms"), py::arg("cached"), py::call_guard<py::gil_scoped_release>())
        .def("combine", &InternodeBuffer::combine, py::arg("x"), py::arg("topk_weights"), py::arg("bias0"), py::arg("bias1"),
             py::arg("rdma_send_pos"), py::arg("count_matrix"), py::arg("node_count"), py::arg("fwd_pos"), py::arg("num_tokens"),
             py::arg("hidden_bytes"), py::arg("num_sms"), py::call_guard<py::gil_scoped_release>())
        .def("destroy", &InternodeBuffer::destroy, py::call_guard<py::gil_scoped_release>());
    m.attr("INTERNODE_MAX_RANKS") = internode::kMaxRanks;
    m.attr("INTERNODE_MAX_RANKS_PER_NODE") = internode::kMaxRanksPerNode;
    m.attr("INTERNODE_MAX_LOCAL_EXPERTS") = internode::kMaxLocalExperts;
    // The one source of the internode buffer's sizes and offsets (Config.get_rdma_buffer_size_hint reads total_bytes).
    using L = InternodeLayout;
    py::class_<L>(m, "InternodeLayout", "Sizes and offsets (bytes) of one rank's internode symmetric buffer.")
        .def_readonly("num_ranks", &L::num_ranks)
        .def_readonly("num_ranks_per_node", &L::num_ranks_per_node)
        .def_readonly("num_nodes", &L::num_nodes)
        .def_readonly("max_tokens", &L::max_tokens)
        .def_readonly("hidden_bytes", &L::hidden_bytes)
        .def_readonly("notify_slot_ints", &L::notify_slot_ints)
        .def_readonly("msg_stride", &L::msg_stride)
        .def_readonly("recv_row_max", &L::recv_row_max)
        .def_readonly("comb_stride_max", &L::comb_stride_max)
        .def_readonly("signal_offset", &L::signal_offset)
        .def_readonly("notify_area_offset", &L::notify_area_offset)
        .def_readonly("notify_stage_offset", &L::notify_stage_offset)
        .def_readonly("data_offset", &L::data_offset)
        .def_readonly("send_stage_offset", &L::send_stage_offset)
        .def_readonly("rdma_recv_offset", &L::rdma_recv_offset)
        .def_readonly("recv_offset", &L::recv_offset)
        .def_readonly("recv_bytes", &L::recv_bytes)
        .def_readonly("comb_nvl_offset", &L::comb_nvl_offset)
        .def_readonly("comb_rdma_offset", &L::comb_rdma_offset)
        .def_readonly("comb_stage_offset", &L::comb_stage_offset)
        .def_readonly("total_bytes", &L::total_bytes);
    m.def(
        "internode_layout",
        [](int64_t hidden_bytes, int num_ranks, int num_ranks_per_node, int max_tokens) {
            return InternodeLayout{internode::make_layout(hidden_bytes, num_ranks, num_ranks_per_node, max_tokens)};
        },
        py::arg("hidden_bytes"), py::arg("num_ranks"), py::arg("num_ranks_per_node"), py::arg("max_tokens"),
        "The internode buffer layout for max_tokens tokens per rank of hidden_bytes.");
    m.def("internode_max_tokens", &internode::max_tokens_for, py::arg("num_bytes"), py::arg("hidden_bytes"), py::arg("num_ranks"),
          py::arg("num_ranks_per_node"));
}

}  // namespace ep
