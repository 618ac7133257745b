// Python bindings of the low-latency engine (ep_dispatcher._C.LowLatencyBuffer). Internal: ep_dispatcher's
// CudaBackend validates arguments, picks the buffer half and owns the call sequence; checks here guard C++ only.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/extension.h>

#include <functional>
#include <memory>
#include <optional>
#include <tuple>
#include <vector>

#include "kernels/common.cuh"
#include "kernels/low_latency.cuh"
#include "binding_checks.h"
#include "runtime/nvshmem_runtime.h"
#include "runtime/timeout_record.h"

namespace py = pybind11;

namespace ep {
namespace {

// The receive phase of one low-latency call, bound at its send phase (the hook's one C++ call: nothing to convert).
class LowLatencyReceive {
   public:
    LowLatencyReceive() = default;
    explicit LowLatencyReceive(std::function<void()> launch) : launch_(std::move(launch)) {}
    void operator()() const { launch_(); }

   private:
    std::function<void()> launch_;
};

// One rank's share of the symmetric low-latency buffer, its peers' direct mappings and the epochs.
class LowLatencyBuffer : public std::enable_shared_from_this<LowLatencyBuffer> {
   public:
    LowLatencyBuffer(int rank, int num_ranks, int64_t num_bytes, bool allow_direct_peers, int64_t timeout_ns, int device, int max_blocks)
        : rank_(rank), num_ranks_(num_ranks), num_bytes_(num_bytes), timeout_ns_(timeout_ns), device_(device), max_blocks_(max_blocks) {
        EP_HOST_ASSERT(num_ranks <= low_latency::kMaxRanks, "low-latency kernels support up to ", low_latency::kMaxRanks, " ranks");
        TORCH_CHECK_VALUE(max_blocks >= 1, "max_blocks: expected >= 1, got ", max_blocks);
        const c10::cuda::CUDAGuard guard(device);
        sync::install_timeout_record(device);
        base_ = static_cast<uint8_t*>(nvshmem_runtime::alloc(num_bytes));
        std::vector<int64_t> peers(num_ranks, 0);
        for (int pe = 0; pe < num_ranks; ++pe) {
            peers[pe] = allow_direct_peers ? nvshmem_runtime::peer_pointer(base_, pe) : 0;
            if (peers[pe] != 0) ++num_direct_peers_;
        }
        EP_CUDA_CHECK(cudaMalloc(&peer_base_, num_ranks * sizeof(int64_t)));
        EP_CUDA_CHECK(cudaMemcpy(peer_base_, peers.data(), num_ranks * sizeof(int64_t), cudaMemcpyHostToDevice));
        EP_CUDA_CHECK(cudaMalloc(&state_, sizeof(low_latency::State)));
        EP_CUDA_CHECK(cudaMemset(state_, 0, sizeof(low_latency::State)));
        // The kernels' error record lives in host-mapped pinned memory: the host reads it without a sync.
        void* error = nullptr;
        EP_CUDA_CHECK(cudaHostAlloc(&error, sizeof(unsigned long long), cudaHostAllocMapped));
        error_host_ = static_cast<volatile unsigned long long*>(error);
        *error_host_ = 0;
        EP_CUDA_CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&error_device_), error, 0));
    }

    int num_direct_peers() const { return num_direct_peers_; }
    int max_blocks() const { return max_blocks_; }

    // Whether the shapes fit in num_bytes_ is checked once, by Buffer (its low-latency size check reads the same
    // make_layout through ep_dispatcher._C.low_latency_layout, once per shape).
    low_latency::Layout layout(int64_t max_tokens, int64_t num_experts, int64_t hidden) const {
        return low_latency::make_layout(num_ranks_, static_cast<int>(num_experts), static_cast<int>(max_tokens), static_cast<int>(hidden));
    }

    low_latency::Half half(int64_t index, const low_latency::Layout& L) const {
        TORCH_CHECK(base_ != nullptr, "low-latency buffer was destroyed");
        TORCH_CHECK_VALUE(index == 0 || index == 1, "half: expected 0 or 1, got ", index);
        auto* trace = phase_trace_.defined() ? reinterpret_cast<unsigned long long*>(phase_trace_.data_ptr<int64_t>()) : nullptr;
        return low_latency::Half{base_ + index * L.half_bytes, peer_base_, index * L.half_bytes, static_cast<int>(index), rank_,
                                 max_blocks_, state_, timeout_ns_, error_device_, trace};
    }

    // Launches the send phase of a dispatch and allocates everything the call returns, so that an eager call makes one
    // C++ entry to send and one (the receive) to receive, with no Python-side allocation: returns (recv_x, recv_scales or
    // None, recv_count, send_slot, src_info, layout_range, receive). recv_x is [E_local, R * T, H] (FP8 or BF16);
    // recv_scales is the token-minor view [E_local, R * T, groups] of a [E_local, groups, R * T] tensor (as grouped GEMMs
    // want); send_slot int32 [num_tokens * num_topk] is each (token, k) entry's slot at its expert (-1: skipped), which the
    // combine reads; src_info [E_local, R * T] int32 and layout_range [E_local, R] int64 are the handle's tensors. The
    // receive phase (receive()) fills recv_x, recv_scales, recv_count, src_info and layout_range.
    // `receive_now`: the caller runs receive() right away (no hook), so both phases may be one kernel
    // (low_latency::dispatch_in_one_kernel); receive() then launches nothing.
    py::tuple dispatch_send(int64_t half_index, const at::Tensor& x, const at::Tensor& topk_idx, int64_t max_tokens, int64_t num_experts,
                            bool use_fp8, bool round_scale, bool use_ue8m0, const OptTensor& cumulative_stats, const OptTensor& wait_stats,
                            bool receive_now) {
        at::Tensor recv_x, recv_scales_storage, recv_count, send_slot, src_info, layout_range;
        LowLatencyReceive receive;
        {
            py::gil_scoped_release no_gil;  // the launch and allocations need no Python
            const c10::cuda::CUDAGuard guard(device_);  // launch on the buffer's device whatever is current
            check(x, "x");
            check(topk_idx, "topk_idx");
            if (cumulative_stats) check(*cumulative_stats, "cumulative_local_expert_recv_stats");
            check_wait_stats(wait_stats, "dispatch_wait_recv_cost_stats");
            const int64_t hidden = x.size(1);
            const auto L = layout(max_tokens, num_experts, hidden);
            const auto h = half(half_index, L);
            const int num_tokens = static_cast<int>(x.size(0)), num_topk = static_cast<int>(topk_idx.size(1));
            TORCH_CHECK_VALUE(num_topk >= 1 && num_topk <= kMaxTopk, "topk_idx: expected 1 <= num_topk <= ", kMaxTopk, ", got ", num_topk);
            const int64_t num_slots = int64_t(num_ranks_) * max_tokens;
            const auto int_options = topk_idx.options().dtype(at::kInt);
            recv_x = at::empty({L.num_local_experts, num_slots, hidden}, x.options().dtype(use_fp8 ? at::kFloat8_e4m3fn : at::kBFloat16));
            if (use_fp8) {
                // UE8M0 packs four power-of-two scales per int32 (one int32 per 512 channels), else one fp32 per 128.
                const int64_t groups = use_ue8m0 ? hidden / 512 : hidden / 128;
                recv_scales_storage =
                    at::empty({L.num_local_experts, groups, num_slots}, x.options().dtype(use_ue8m0 ? at::kInt : at::kFloat));
            }
            recv_count = at::empty({L.num_local_experts}, int_options);
            send_slot = at::empty({int64_t(num_tokens) * num_topk}, int_options);
            src_info = at::empty({L.num_local_experts, num_slots}, int_options);
            layout_range = at::empty({L.num_local_experts, int64_t(num_ranks_)}, topk_idx.options());
            void* scales_out = recv_scales_storage.defined() ? recv_scales_storage.data_ptr() : nullptr;
            const low_latency::ReceiveOutputs outputs{recv_x.data_ptr(),
                                                      scales_out,
                                                      src_info.data_ptr<int>(),
                                                      layout_range.data_ptr<int64_t>(),
                                                      recv_count.data_ptr<int>(),
                                                      cumulative_stats ? cumulative_stats->data_ptr<int>() : nullptr,
                                                      wait_stats ? wait_stats->data_ptr<int64_t>() : nullptr};
            const bool all_direct = num_direct_peers_ == num_ranks_;
            if (receive_now && low_latency::dispatch_in_one_kernel(L, h, x.data_ptr(), topk_idx.data_ptr<int64_t>(), num_tokens, num_topk,
                                                                   use_fp8, round_scale, use_ue8m0, all_direct, send_slot.data_ptr<int>(),
                                                                   outputs, stream())) {
                receive = LowLatencyReceive([] {});  // received in the same kernel
            } else {
                const low_latency::DirectReceive direct{outputs, use_ue8m0, low_latency::one_rank_fused(L)};
                low_latency::dispatch_send(L, h, x.data_ptr(), topk_idx.data_ptr<int64_t>(), num_tokens, num_topk, use_fp8, round_scale,
                                           all_direct, send_slot.data_ptr<int>(), direct, stream());
                // The receive phase, bound now: the hook's call converts no arguments. It holds the buffer (shared_ptr) and
                // the outputs, so a hook run after destroy() raises (half() checks base_) instead of touching freed memory.
                auto self = shared_from_this();
                receive = LowLatencyReceive([self, half_index, max_tokens, num_experts, hidden, use_fp8, use_ue8m0, outputs, recv_x,
                                             recv_scales_storage, src_info, layout_range, recv_count, cumulative_stats, wait_stats] {
                    const c10::cuda::CUDAGuard guard(self->device_);  // launch on the buffer's device whatever is current
                    const auto L = self->layout(max_tokens, num_experts, hidden);
                    low_latency::dispatch_recv(L, self->half(half_index, L), use_fp8, use_ue8m0, outputs, self->stream());
                });
            }
        }
        py::object recv_scales = py::none();
        if (recv_scales_storage.defined()) {
            const int64_t num_local_experts = recv_scales_storage.size(0), groups = recv_scales_storage.size(1),
                          num_slots = recv_scales_storage.size(2);
            // One group: same memory, but a unit last stride: torch calls such a view contiguous, so .contiguous() keeps
            // it, and callers that view it as bytes (DeepEP's test does for UE8M0) need stride(-1) == 1.
            recv_scales = py::cast(groups == 1 ? recv_scales_storage.as_strided({num_local_experts, num_slots, 1}, {num_slots, 1, 1})
                                               : recv_scales_storage.transpose(1, 2));
        }
        return py::make_tuple(recv_x, recv_scales, recv_count, send_slot, src_info, layout_range, std::move(receive));
    }

    // Launches the send phase of a combine and allocates `out` [num_tokens, hidden] bf16 unless given: returns (out,
    // receive); receive() writes out (the receive phase). `receive_now`: as dispatch_send's.
    py::tuple combine_send(int64_t half_index, const at::Tensor& x, const at::Tensor& layout_range, int64_t max_tokens, int64_t num_experts,
                           const at::Tensor& topk_idx, const at::Tensor& topk_weights, const at::Tensor& send_slot,
                           const OptTensor& out_arg, const OptTensor& wait_stats, bool receive_now) {
        at::Tensor out;
        LowLatencyReceive receive;
        {
            py::gil_scoped_release no_gil;  // the launch and the allocation need no Python
            const c10::cuda::CUDAGuard guard(device_);  // launch on the buffer's device whatever is current
            check(x, "x");
            check(layout_range, "layout_range");
            for (const auto* t : {&topk_idx, &topk_weights, &send_slot}) check(*t, "combine input");
            check_wait_stats(wait_stats, "combine_wait_recv_cost_stats");
            const int64_t hidden = x.size(2);
            out = out_arg ? *out_arg : at::empty({topk_idx.size(0), hidden}, x.options().dtype(at::kBFloat16));
            check(out, "combine input");
            const auto L = layout(max_tokens, num_experts, hidden);
            const auto h = half(half_index, L);
            const bool staged = x.data_ptr() == static_cast<void*>(h.local + L.send_offset());
            const bool all_direct = num_direct_peers_ == num_ranks_;
            const low_latency::ReduceArgs args{topk_idx.data_ptr<int64_t>(),
                                               topk_weights.data_ptr<float>(),
                                               send_slot.data_ptr<int>(),
                                               static_cast<int>(topk_idx.size(0)),
                                               static_cast<int>(topk_idx.size(1)),
                                               out.data_ptr(),
                                               wait_stats ? wait_stats->data_ptr<int64_t>() : nullptr};
            if (receive_now && low_latency::combine_in_one_kernel(L, h, x.data_ptr(), staged, all_direct, layout_range.data_ptr<int64_t>(),
                                                                  args, max_blocks_, stream())) {
                receive = LowLatencyReceive([] {});  // reduced in the same kernel
            } else {
                low_latency::combine_send(L, h, x.data_ptr(), staged, all_direct, layout_range.data_ptr<int64_t>(), stream());
                auto self = shared_from_this();
                receive = LowLatencyReceive([self, half_index, max_tokens, num_experts, hidden, args, staged, topk_idx, topk_weights, send_slot,
                                             out, wait_stats] {
                    const c10::cuda::CUDAGuard guard(self->device_);  // launch on the buffer's device whatever is current
                    const auto L = self->layout(max_tokens, num_experts, hidden);
                    low_latency::combine_recv(L, self->half(half_index, L), args, staged, self->max_blocks_, self->stream());
                });
            }
        }
        return py::make_tuple(out, std::move(receive));
    }

    // The half's send area as the [E_local, R * T, H] bf16 combine input (zero-copy combine).
    at::Tensor combine_buffer(int64_t half_index, int64_t max_tokens, int64_t num_experts, int64_t hidden) const {
        const auto L = layout(max_tokens, num_experts, hidden);
        const auto h = half(half_index, L);
        const auto options = at::TensorOptions().dtype(at::kBFloat16).device(at::kCUDA, device_);
        return at::from_blob(h.local + L.send_offset(), {L.num_local_experts, int64_t(num_ranks_) * max_tokens, hidden}, options);
    }

    // The kernels' last error record as (code, token, k, value) and clears it, or None. No sync: it reports what the
    // kernels that have run so far found (low_latency.cuh: ErrorCode).
    py::object take_error() {
        if (error_host_ == nullptr) return py::none();
        const unsigned long long record = *error_host_;
        if (record == 0) return py::none();
        *error_host_ = 0;
        const int code = static_cast<int>(record >> low_latency::kErrorCodeShift);
        const int k = static_cast<int>((record >> low_latency::kErrorKShift) & low_latency::kErrorKMask);
        const int token = static_cast<int>((record >> low_latency::kErrorTokenShift) & low_latency::kErrorTokenMask);
        const int64_t value = static_cast<int32_t>(static_cast<uint32_t>(record));
        return py::make_tuple(code, token, k, value);
    }

    // Profiling (benchmarks/profile_low_latency.py --phase-trace): the kernels launched from now on stamp their phases into
    // `trace` (int64 [kTraceKernels, kTraceBlocks, kTracePoints], global timer ns, see low_latency.cuh); None stops it.
    void set_phase_trace(const OptTensor& trace) {
        if (trace) {
            check(*trace, "trace");
            TORCH_CHECK_VALUE(trace->scalar_type() == at::kLong && trace->is_contiguous() && trace->numel() == low_latency::kTraceInts,
                              "trace: expected a contiguous int64 tensor of ", low_latency::kTraceInts, " elements, got ",
                              trace->scalar_type(), " ", trace->sizes());
        }
        phase_trace_ = trace ? *trace : at::Tensor();
    }

    // The widest grid of a dispatch or combine of `num_tokens` tokens, in 512-thread block equivalents.
    int grid_blocks(int64_t num_tokens, int64_t max_tokens, int64_t num_experts, int64_t hidden) const {
        return low_latency::widest_grid_blocks(layout(max_tokens, num_experts, hidden), max_blocks_, static_cast<int>(num_tokens));
    }

    // Collective: zero the whole buffer and the epochs (after the ranks' previous work has finished).
    void clean() {
        TORCH_CHECK(base_ != nullptr, "low-latency buffer was destroyed");
        const c10::cuda::CUDAGuard guard(device_);
        EP_CUDA_CHECK(cudaDeviceSynchronize());
        nvshmem_runtime::barrier_all();
        EP_CUDA_CHECK(cudaMemset(base_, 0, num_bytes_));
        EP_CUDA_CHECK(cudaMemset(state_, 0, sizeof(low_latency::State)));
        EP_CUDA_CHECK(cudaDeviceSynchronize());
        nvshmem_runtime::barrier_all();
    }

    // Collective (nvshmem_free).
    void destroy() {
        const c10::cuda::CUDAGuard guard(device_);
        if (!nvshmem_runtime::sync_and_free(base_)) return;
        cudaFree(peer_base_);
        cudaFree(state_);
        cudaFreeHost(const_cast<unsigned long long*>(error_host_));
        error_host_ = nullptr;
    }

   private:
    void check(const at::Tensor& t, const char* name) const {
        check_cuda_tensor(t, name, device_);
    }
    // The kernels atomically add to wait_stats[r] for r < num_ranks: it must be [num_ranks] int64 and contiguous.
    void check_wait_stats(const OptTensor& stats, const char* name) const {
        if (!stats) return;
        check(*stats, name);
        TORCH_CHECK_VALUE(stats->scalar_type() == at::kLong && stats->dim() == 1 && stats->size(0) == num_ranks_ && stats->is_contiguous(),
                          name, ": expected a contiguous [", num_ranks_, "] int64 tensor, got ", stats->scalar_type(), " ", stats->sizes());
    }
    cudaStream_t stream() const { return c10::cuda::getCurrentCUDAStream(device_); }

    int rank_, num_ranks_;
    int64_t num_bytes_, timeout_ns_;
    int device_;
    int max_blocks_;
    int num_direct_peers_ = 0;
    uint8_t* base_ = nullptr;
    int64_t* peer_base_ = nullptr;
    low_latency::State* state_ = nullptr;
    volatile unsigned long long* error_host_ = nullptr;  // written by the kernels (one 8-byte store per record)
    unsigned long long* error_device_ = nullptr;
    at::Tensor phase_trace_;  // undefined: no phase stamps (set_phase_trace)
};

// The layout as Python sees it: a type of this file's anonymous namespace, so that its pybind11 class has the
// module's hidden visibility (binding ep::low_latency::Layout itself makes GCC warn about the visibility).
struct LowLatencyLayout : low_latency::Layout {};

}  // namespace

void register_low_latency(py::module_& m) {
    // The shape of a phase-trace tensor (LowLatencyBuffer.set_phase_trace): (kernels, blocks, points).
    m.attr("low_latency_trace_shape") = py::make_tuple(static_cast<int>(low_latency::kTraceKernels), low_latency::kTraceBlocks,
                                                       static_cast<int>(low_latency::kTracePoints));
    py::class_<LowLatencyReceive>(m, "LowLatencyReceive", "The receive phase of one low-latency call (call it once).")
        .def("__call__", &LowLatencyReceive::operator(), py::call_guard<py::gil_scoped_release>());
    // Held by shared_ptr: a pending receive (LowLatencyReceive) keeps the buffer alive.
    py::class_<LowLatencyBuffer, std::shared_ptr<LowLatencyBuffer>>(m, "LowLatencyBuffer",
                                                                    "One rank's NVSHMEM low-latency buffer (two halves) and its epochs.")
        .def(py::init<int, int, int64_t, bool, int64_t, int, int>(), py::arg("rank"), py::arg("num_ranks"), py::arg("num_bytes"),
             py::arg("allow_direct_peers"), py::arg("timeout_ns"), py::arg("device"), py::arg("max_blocks"))
        .def_property_readonly("max_blocks", [](const LowLatencyBuffer& b) { return b.max_blocks(); })
        .def_property_readonly("num_direct_peers", &LowLatencyBuffer::num_direct_peers)
        .def(
            "half_bytes", [](const LowLatencyBuffer& b, int64_t t, int64_t e, int64_t h) { return b.layout(t, e, h).half_bytes; },
            py::arg("max_tokens"), py::arg("num_experts"), py::arg("hidden"))
        // Internal entries (ep_dispatcher.backends.cuda.low_latency): positional, no keyword names to match per call.
        .def("dispatch_send", &LowLatencyBuffer::dispatch_send)
        .def("combine_send", &LowLatencyBuffer::combine_send)
        .def("combine_buffer", &LowLatencyBuffer::combine_buffer, py::arg("half_index"), py::arg("max_tokens"), py::arg("num_experts"),
             py::arg("hidden"))
        .def("take_error", &LowLatencyBuffer::take_error)
        .def("set_phase_trace", &LowLatencyBuffer::set_phase_trace, py::arg("trace"))
        .def("grid_blocks", &LowLatencyBuffer::grid_blocks, py::arg("num_tokens"), py::arg("max_tokens"), py::arg("num_experts"),
             py::arg("hidden"))
        .def("clean", &LowLatencyBuffer::clean, py::call_guard<py::gil_scoped_release>())
        .def("destroy", &LowLatencyBuffer::destroy, py::call_guard<py::gil_scoped_release>());
    // The one source of the low-latency buffer's sizes and offsets (Buffer.get_low_latency_rdma_size_hint reads
    // total_bytes).
    using L = LowLatencyLayout;
    py::class_<L>(m, "LowLatencyLayout", "Sizes and offsets (bytes) of one half of a rank's low-latency buffer; two halves.")
        .def_readonly("num_ranks", &L::num_ranks)
        .def_readonly("num_experts", &L::num_experts)
        .def_readonly("num_local_experts", &L::num_local_experts)
        .def_readonly("max_tokens", &L::max_tokens)
        .def_readonly("hidden", &L::hidden)
        .def_readonly("dispatch_msg_bytes", &L::dispatch_msg_bytes)
        .def_readonly("send_bytes", &L::send_bytes)
        .def_readonly("recv_bytes", &L::recv_bytes)
        .def_readonly("signal_bytes", &L::signal_bytes)
        .def_readonly("half_bytes", &L::half_bytes)
        .def_property_readonly("send_offset", &L::send_offset)
        .def_property_readonly("recv_offset", &L::recv_offset)
        .def_property_readonly("dispatch_signal_offset", &L::dispatch_signal_offset)
        .def_property_readonly("combine_signal_offset", &L::combine_signal_offset)
        .def_property_readonly("ack_offset", &L::ack_offset)
        .def_property_readonly("total_bytes", [](const L& l) { return 2 * l.half_bytes; });
    m.def(
        "low_latency_layout",
        [](int num_ranks, int num_experts, int max_tokens, int hidden) {
            return LowLatencyLayout{low_latency::make_layout(num_ranks, num_experts, max_tokens, hidden)};
        },
        py::arg("num_ranks"), py::arg("num_experts"), py::arg("max_tokens"), py::arg("hidden"),
        "The low-latency buffer layout (one half; total_bytes covers both).");
    m.def("nvshmem_init", &nvshmem_runtime::init, py::arg("unique_id"), py::arg("rank"), py::arg("num_ranks"),
          "Collective: initialise NVSHMEM on the current device from rank 0's unique id (once per process).");
    m.def("nvshmem_is_initialized", &nvshmem_runtime::is_initialized);
}

}  // namespace ep
