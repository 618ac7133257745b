// Python bindings of the CUDA engine: ep_dispatcher._C.
//
// This file validates arguments at the edge (bad arguments raise ValueError naming the argument, the value
// received and what is expected), allocates outputs through torch's caching allocator on the input's device, and
// launches on torch's current stream. Kernels and runtime pieces live under kernels/ and runtime/.
// c10's stream/guard headers rather than ATen/cuda/CUDAContext.h: the latter pulls in cuBLAS/cuSPARSE headers,
// which minimal CUDA toolkits (nvcc + cudart only) lack. c10::cuda::getCurrentCUDAStream is the same stream as
// at::cuda::getCurrentCUDAStream.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <unordered_map>

#include "kernels/layout.cuh"
#include "kernels/logfmt.cuh"
#include "kernels/pending_kernels.h"
#include "runtime/nvshmem_runtime.h"
#include "runtime/timeout_record.h"

namespace py = pybind11;

// setup.py passes the version and the arch list as bare preprocessor tokens (a quoted string would not survive
// the shell/ninja round trip), e.g. -DEP_DISPATCHER_VERSION=0.1.0 -DEP_DISPATCHER_CUDA_ARCHS=90_90a_100.
#define EP_STRINGIFY_IMPL(x) #x
#define EP_STRINGIFY(x) EP_STRINGIFY_IMPL(x)
#ifndef EP_DISPATCHER_VERSION
#define EP_DISPATCHER_VERSION unknown
#endif
#ifndef EP_DISPATCHER_CUDA_ARCHS
#define EP_DISPATCHER_CUDA_ARCHS unknown
#endif

// Argument check at the API edge: raises c10::ValueError (Python ValueError) with the function name and the
// caller's message, which names the argument, the value received and the expected value.
#define EP_CHECK_ARG(cond, function, ...) TORCH_CHECK_VALUE(cond, function, ": ", __VA_ARGS__)

namespace ep {
namespace {

// SM count of `device`, queried once per device: later calls (e.g. during CUDA-graph capture) make no CUDA call.
int multiprocessor_count(int device) {
    static std::mutex mutex;
    static std::unordered_map<int, int> counts;
    const std::lock_guard<std::mutex> lock(mutex);
    const auto found = counts.find(device);
    if (found != counts.end()) return found->second;
    int count = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device));
    counts.emplace(device, count);
    return count;
}

using DispatchLayout = std::tuple<at::Tensor, std::optional<at::Tensor>, at::Tensor, at::Tensor>;

DispatchLayout get_dispatch_layout(const at::Tensor& topk_idx, int64_t num_experts, int64_t num_ranks, int64_t num_ranks_per_node) {
    constexpr const char* kFn = "get_dispatch_layout";
    EP_CHECK_ARG(topk_idx.defined(), kFn, "topk_idx must be a tensor, got an undefined tensor");
    EP_CHECK_ARG(topk_idx.is_cuda(), kFn, "topk_idx must be a CUDA tensor, got device ", topk_idx.device());
    EP_CHECK_ARG(topk_idx.scalar_type() == at::kLong, kFn, "topk_idx must have dtype torch.int64, got ", topk_idx.scalar_type());
    EP_CHECK_ARG(topk_idx.dim() == 2, kFn, "topk_idx must be 2-D [num_tokens, num_topk], got shape ", topk_idx.sizes());
    EP_CHECK_ARG(topk_idx.is_contiguous(), kFn, "topk_idx must be contiguous, got shape ", topk_idx.sizes(), " with strides ",
                 topk_idx.strides());
    EP_CHECK_ARG(num_ranks > 0 && num_ranks <= INT32_MAX, kFn, "num_ranks must be in [1, 2^31), got ", num_ranks);
    EP_CHECK_ARG(num_experts > 0 && num_experts <= INT32_MAX, kFn, "num_experts must be in [1, 2^31), got ", num_experts);
    EP_CHECK_ARG(num_experts % num_ranks == 0, kFn, "num_experts must be a multiple of num_ranks=", num_ranks, ", got ", num_experts);
    EP_CHECK_ARG(num_ranks_per_node > 0, kFn, "num_ranks_per_node must be positive, got ", num_ranks_per_node);
    const bool spans_nodes = num_ranks > num_ranks_per_node;
    EP_CHECK_ARG(!spans_nodes || num_ranks % num_ranks_per_node == 0, kFn,
                 "num_ranks must be a multiple of num_ranks_per_node=", num_ranks_per_node, " when it exceeds it, got ", num_ranks);
    const int64_t num_tokens = topk_idx.size(0);
    const int64_t num_topk = topk_idx.size(1);
    // The kernel indexes entries and is_token_in_rank with 32-bit integers.
    EP_CHECK_ARG(num_tokens * std::max(num_topk, num_ranks) <= INT32_MAX, kFn,
                 "num_tokens * max(num_topk, num_ranks) must be < 2^31, got num_tokens=", num_tokens, " num_topk=", num_topk,
                 " num_ranks=", num_ranks);

    // Allocations and the launch go to topk_idx's device, whatever the current device is.
    const c10::cuda::CUDAGuard device_guard(topk_idx.device());
    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
    const int num_sms = multiprocessor_count(topk_idx.get_device());

    // One allocation for every output (each allocation is host time on the hot path): the three counter arrays
    // [ranks | experts | nodes], one array for the launcher (the owner kernel stores all of it, the fallback zero-fills
    // it first), then is_token_in_rank's bytes. The outputs are views of it.
    const int64_t num_nodes = spans_nodes ? num_ranks / num_ranks_per_node : 0;
    const int64_t num_counters = num_ranks + num_experts + num_nodes;
    // is_token_in_rank starts 16-byte aligned: the dispatch's send-position scan reads it in 16-byte vectors only then
    // (counters of 1 rank + 256 experts end at byte 1028; the byte path cost 27 us at EP = 1, 65536 tokens).
    // Each view is a tensor op of about a microsecond of host time, so the storage is int32 (the counters are narrows of
    // it) and the flags one dtype view and one as_strided of it, instead of narrow + view chains.
    const int64_t flags_offset = (num_counters * static_cast<int64_t>(sizeof(int)) + 15) / 16 * 16;
    const int64_t storage_words = (flags_offset + num_tokens * num_ranks + 3) / 4;
    at::Tensor storage = at::empty({storage_words}, topk_idx.options().dtype(at::kInt));
    at::Tensor num_tokens_per_rank = storage.narrow(0, 0, num_ranks);
    at::Tensor num_tokens_per_expert = storage.narrow(0, num_ranks, num_experts);
    std::optional<at::Tensor> num_tokens_per_rdma_rank;
    if (spans_nodes) num_tokens_per_rdma_rank = storage.narrow(0, num_ranks + num_experts, num_nodes);
    at::Tensor is_token_in_rank = storage.view(at::kBool).as_strided({num_tokens, num_ranks}, {num_ranks, 1}, flags_offset);

    layout::get_dispatch_layout(topk_idx.data_ptr<int64_t>(), static_cast<int>(num_tokens), static_cast<int>(num_topk),
                                static_cast<int>(num_experts), static_cast<int>(num_ranks), static_cast<int>(num_ranks_per_node),
                                num_tokens_per_rank.data_ptr<int>(), spans_nodes ? num_tokens_per_rdma_rank->data_ptr<int>() : nullptr,
                                num_tokens_per_expert.data_ptr<int>(), is_token_in_rank.data_ptr<bool>(), num_sms, stream);
    return {num_tokens_per_rank, num_tokens_per_rdma_rank, num_tokens_per_expert, is_token_in_rank};
}

// LogFMT-10 encode/decode round trip of a BF16 tensor (kernels/logfmt.cu); in place when `inplace`.
at::Tensor logfmt_roundtrip(const at::Tensor& x, bool inplace) {
    EP_CHECK_ARG(x.is_cuda(), "logfmt_roundtrip", "x: expected a CUDA tensor, got one on ", x.device());
    EP_CHECK_ARG(x.scalar_type() == at::kBFloat16, "logfmt_roundtrip", "x: expected dtype bfloat16, got ", x.scalar_type());
    EP_CHECK_ARG(x.is_contiguous(), "logfmt_roundtrip", "x: expected a contiguous tensor, got strides ", x.strides());
    EP_CHECK_ARG(x.dim() >= 1 && x.size(-1) % logfmt::kGroupSize == 0, "logfmt_roundtrip",
                 "x: expected the last dimension to be a multiple of ", logfmt::kGroupSize, ", got shape ", x.sizes());
    const c10::cuda::CUDAGuard guard(x.device());
    at::Tensor out = inplace ? x : at::empty_like(x);
    logfmt::roundtrip(x.data_ptr(), out.data_ptr(), x.numel() / logfmt::kGroupSize, c10::cuda::getCurrentCUDAStream());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return out;
}

std::string cuda_arch_list() {
    std::string archs = EP_STRINGIFY(EP_DISPATCHER_CUDA_ARCHS);
    std::replace(archs.begin(), archs.end(), '_', ';');
    return archs;
}

}  // namespace
}  // namespace ep

namespace ep {
void register_intranode(py::module_& m);    // intranode_bindings.cpp
void register_low_latency(py::module_& m);  // low_latency_bindings.cpp
void register_internode(py::module_& m);    // internode_bindings.cpp
}  // namespace ep

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.doc() = "ep_dispatcher CUDA engine (use ep_dispatcher.Buffer; these bindings are internal)";
    ep::register_intranode(m);
    ep::register_low_latency(m);
    ep::register_internode(m);

    m.def("get_dispatch_layout", &ep::get_dispatch_layout, py::arg("topk_idx"), py::arg("num_experts"), py::arg("num_ranks"),
          py::arg("num_ranks_per_node"), py::call_guard<py::gil_scoped_release>(),
          R"doc(Dispatch layout of a top-k routing, on the current CUDA stream, without host sync (graph-capturable).

Args:
    topk_idx: [num_tokens, num_topk] int64, CUDA, contiguous; expert ids in [0, num_experts), -1 = no expert
        (ids outside [0, num_experts) are ignored like -1: checking them would need a host sync).
    num_experts: total experts, a multiple of num_ranks; expert e lives on rank e // (num_experts // num_ranks).
    num_ranks: ranks in the expert-parallel group.
    num_ranks_per_node: ranks per node (NVLink domain); rank r is on node r // num_ranks_per_node.

Returns:
    (num_tokens_per_rank [num_ranks] int32: tokens with >= 1 expert on each rank, counted once per token,
     num_tokens_per_rdma_rank [num_ranks // num_ranks_per_node] int32, likewise per node, or None when
         num_ranks <= num_ranks_per_node,
     num_tokens_per_expert [num_experts] int32: (token, k) entries per expert,
     is_token_in_rank [num_tokens, num_ranks] bool)

Raises ValueError for bad arguments, RuntimeError for CUDA errors.)doc");

    m.def("logfmt_roundtrip", &ep::logfmt_roundtrip, py::arg("x"), py::arg("inplace") = false,
          "LogFMT-10 encode + decode of a contiguous CUDA bfloat16 tensor (last dim % 128 == 0), bit-exact with "
          "ep_dispatcher.logfmt.logfmt_roundtrip; returns a new tensor, or x itself when inplace.");

    m.def("has_nvshmem", &ep::nvshmem_runtime::built_with_nvshmem, "Whether this build links NVSHMEM (internode / low-latency kernels).");

    m.def(
        "nvshmem_get_unique_id",
        []() {
            const std::string unique_id = ep::nvshmem_runtime::get_unique_id();
            return py::bytes(unique_id);
        },
        "A fresh NVSHMEM unique id (bytes) for rank 0 to broadcast; RuntimeError when built without NVSHMEM.");

    m.def(
        "version", []() { return std::string(EP_STRINGIFY(EP_DISPATCHER_VERSION)); },
        "Version of ep_dispatcher this extension was built from.");

    m.def("timeout_report", &ep::sync::timeout_report,
          "The first timed-out wait of this process (rank, peer, stage, epoch), read from host memory: it survives the "
          "trap that faults the CUDA context. Empty if no wait timed out.");
    m.def("cuda_arch_list", &ep::cuda_arch_list, "CUDA architectures compiled in, ';'-separated (e.g. \"90\" or \"90;90a;100\").");
    m.def("pending_kernels_enabled", &ep::pending_kernels_enabled,
          "Whether this process runs the kernels that await GPU verification (EP_DISPATCHER_PENDING_KERNELS=1, read once).");
}
