// Python bindings of the intranode engine (ep_dispatcher._C.IpcBuffer, intranode_*). Internal: ep_dispatcher's
// CudaBackend validates arguments and owns the call sequence; the checks here guard the C++ side only.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/extension.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <optional>
#include <sstream>
#include <thread>
#include <tuple>
#include <vector>

#include "binding_checks.h"
#include "kernels/intranode.cuh"
#include "kernels/stages.h"
#include "runtime/ipc_buffer.h"
#include "runtime/timeout_record.h"

namespace py = pybind11;

namespace ep {
namespace {

void check_cuda(const at::Tensor& t, const char* name, const IpcBuffer& buffer) {
    check_cuda_tensor(t, name, buffer.device());
}

using DispatchOutputs = std::tuple<at::Tensor, OptTensor, OptTensor, OptTensor, at::Tensor>;

// Published offsets with every field marked "not written by this call" (-1); a call fills in the fields it uses.
intranode::Published nothing_published() {
    intranode::Published publish{};
    for (int64_t& v : publish.value) v = -1;
    return publish;
}

// Bounds the rows a dispatch of this shape can receive, against the pool's size (an empty pool's worth).
void check_receive_capacity(const IpcBuffer& buffer, int64_t rows, int x_row, int scale_row, int num_topk) {
    const int capacity = intranode::dispatch_capacity(buffer.pool().capacity(), x_row, scale_row, num_topk);
    TORCH_CHECK_VALUE(rows <= capacity, "num_nvl_bytes: the buffer holds ", capacity, " received rows of this shape, this dispatch needs ",
                      rows, "; create the Buffer with more num_nvl_bytes");
}

// A dispatch's outputs: tensors on the pool block at `block`, laid out by receive_layout (the layout the senders
// address). recv_src is empty without `layout`'s source field (cached dispatch).
struct ReceiveTensors {
    at::Tensor x;
    OptTensor scales, topk, weights;
    at::Tensor src;
};
ReceiveTensors receive_tensors(RecvPool& pool, int64_t block, const intranode::ReceiveLayout& layout, int64_t rows, const at::Tensor& x,
                               const OptTensor& scales, int num_topk, bool with_src, cudaStream_t stream) {
    ReceiveTensors out;
    out.x = pool.tensor_at(block + layout.x, {rows, x.size(1)}, x.scalar_type(), stream);
    if (scales) out.scales = pool.tensor_at(block + layout.scales, {rows, scales->size(1)}, scales->scalar_type(), stream);
    if (num_topk > 0) {
        out.topk = pool.tensor_at(block + layout.topk, {rows, num_topk}, at::kLong, stream);
        out.weights = pool.tensor_at(block + layout.weights, {rows, num_topk}, at::kFloat, stream);
    }
    out.src = with_src ? pool.tensor_at(block + layout.src, {rows}, at::kInt, stream) : at::empty({0}, x.options().dtype(at::kInt));
    return out;
}

// A dispatch's payload, checked (x [num_tokens, hidden]; scales and top-k optional, weights required with top-k; all
// on the buffer's device), and the row shape every rank must share.
struct PayloadRows {
    int x_row, scale_row, num_topk;
};
PayloadRows check_payload(const IpcBuffer& buffer, const at::Tensor& x, const OptTensor& scales, const OptTensor& topk_idx,
                          const OptTensor& topk_weights) {
    TORCH_CHECK_VALUE(x.dim() == 2, "x: expected [num_tokens, hidden]");
    if (scales) check_cuda(*scales, "scales", buffer);
    if (topk_idx) {
        check_cuda(*topk_idx, "topk_idx", buffer);
        TORCH_CHECK_VALUE(topk_weights.has_value(), "topk_weights: required with topk_idx");
        check_cuda(*topk_weights, "topk_weights", buffer);
    }
    return {static_cast<int>(x.size(1) * x.element_size()), scales ? static_cast<int>(scales->size(1) * scales->element_size()) : 0,
            topk_idx ? static_cast<int>(topk_idx->size(1)) : 0};
}

// The data part of a cached dispatch, and of a fresh one whose rows did not fit where notify placed them: this rank's
// outputs come from its receive pool, their offsets are published at a barrier, every sender writes its rows straight
// into them, and a barrier ends the call. A fresh dispatch also returns recv_src_idx and the top-k outputs.
DispatchOutputs dispatch(IpcBuffer& buffer, const at::Tensor& x, const OptTensor& scales, const OptTensor& topk_idx,
                         const OptTensor& topk_weights, int64_t num_local_experts, const at::Tensor& is_token_in_rank,
                         const at::Tensor& send_pos, const at::Tensor& count_matrix, int64_t rows_out, int64_t num_sms, int64_t timeout_ns,
                         bool fresh) {
    TORCH_CHECK(buffer.is_open(), "intranode_dispatch: peers are not mapped");
    for (const auto& [t, name] : {std::pair{&x, "x"}, {&is_token_in_rank, "is_token_in_rank"}, {&send_pos, "send_pos"},
                                  {&count_matrix, "count_matrix"}})
        check_cuda(*t, name, buffer);
    const auto [x_row, scale_row, num_topk] = check_payload(buffer, x, scales, topk_idx, topk_weights);
    const c10::cuda::CUDAGuard guard(x.device());
    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
    const int R = buffer.num_ranks();
    const int num_tokens = static_cast<int>(x.size(0));
    check_receive_capacity(buffer, rows_out, x_row, scale_row, num_topk);

    // Room first: making it may move earlier outputs out of the pool (the inputs of this call among them), so no data
    // pointer is read before this point.
    RecvPool& pool = buffer.pool();
    const intranode::ReceiveLayout layout = intranode::receive_layout(rows_out, x_row, scale_row, num_topk, fresh);
    const int64_t block = pool.take_block(layout.end, true, stream).first;
    ReceiveTensors out = receive_tensors(pool, block, layout, rows_out, x, scales, num_topk, fresh, stream);
    pool.end_block(layout.end);

    intranode::Published publish = nothing_published();
    publish.value[intranode::kPubRecvX] = block + layout.x;
    if (scales) publish.value[intranode::kPubRecvScales] = block + layout.scales;
    if (num_topk > 0) {
        publish.value[intranode::kPubRecvTopk] = block + layout.topk;
        publish.value[intranode::kPubRecvWeights] = block + layout.weights;
    }
    if (fresh) publish.value[intranode::kPubRecvSrc] = block + layout.src;
    publish.value[intranode::kPubRecvRows] = rows_out;
    // Every rank's previous use of its outputs' regions is over, and every rank's offsets are known, past this barrier.
    intranode::barrier(buffer.peers(), buffer.rank(), R, buffer.epoch(), timeout_ns, sync::kStageDispatchReady, &publish, stream);
    intranode::dispatch(buffer.peers(), buffer.rank(), R, x.data_ptr(), x_row, scales ? scales->data_ptr() : nullptr, scale_row,
                        topk_idx ? topk_idx->data_ptr<int64_t>() : nullptr, topk_weights ? topk_weights->data_ptr<float>() : nullptr,
                        num_topk, static_cast<int>(num_local_experts), is_token_in_rank.data_ptr<bool>(), send_pos.data_ptr<int>(),
                        count_matrix.data_ptr<int>(), nullptr, nullptr, num_tokens, static_cast<int>(num_sms), stream);
    intranode::barrier(buffer.peers(), buffer.rank(), R, buffer.epoch(), timeout_ns, sync::kStageDispatchData, nullptr, stream);
    return {out.x, out.scales, out.topk, out.weights, out.src};
}

// Raises the input error a count exchange reported (every rank gets the same, lowest rank's, error).
void raise_input_error(const intranode::InputError& error, int my_rank, int64_t num_experts) {
    std::ostringstream where;
    if (error.rank != my_rank) where << " (on rank " << error.rank << ")";
    if (error.code == intranode::kTopkIdxOutOfRange)
        TORCH_CHECK_VALUE(false, "topk_idx: expected entries in [-1, ", num_experts, ") (-1 = no expert), got ", error.value, " at token ",
                          error.where, ", column ", error.slot, where.str());
    if (error.code == intranode::kTokensPerRankMismatch)
        TORCH_CHECK_VALUE(false, "num_tokens_per_rank: entry ", error.where, " is ", error.value, " but is_token_in_rank sends ",
                          error.slot, " tokens to rank ", error.where, where.str(),
                          "; pass the counts get_dispatch_layout returned with it");
    if (error.code == intranode::kRowShapeMismatch) {
        static const char* const what[] = {"x: row bytes (hidden x element size)", "x_scales: row bytes", "topk_idx: top-k width"};
        TORCH_CHECK_VALUE(false, what[error.where], " must be the same on every rank: this rank has ", error.slot, ", rank ", error.rank,
                          " has ", error.value);
    }
    TORCH_CHECK(false, "intranode dispatch: unknown input error code ", error.code, where.str());
}

// A call that did not wait (num_worst_tokens) reports its input error at the next fresh dispatch, at the latest.
void raise_unchecked_input_error(IpcBuffer& buffer, int rank, int64_t num_experts) {
    if (buffer.unchecked_report_tag != 0 && buffer.report()->tag == buffer.unchecked_report_tag) {
        const intranode::InputError error = buffer.report()->error;
        buffer.unchecked_report_tag = 0;
        if (error.code != intranode::kInputOk) raise_input_error(error, rank, num_experts);
    }
}

// Waits until the notify kernel has published report `tag`, by polling host-mapped memory: no stream sync, so the
// host is free as soon as the counts exist. Fails (instead of hanging) if the stream faults or the wait times out.
void wait_for_report(const IpcBuffer& buffer, int tag, cudaStream_t stream, int64_t timeout_ns) {
    const volatile int* published = &buffer.report()->tag;
    const auto start = std::chrono::steady_clock::now();
    // The kernels' own timeouts (which name the peer and stage, then fault the stream) fire first; the host's is a
    // backstop for a stream that never reaches notify.
    const int64_t host_timeout_ns = 2 * timeout_ns + 1000000000LL;
    constexpr int kSpinsPerCheck = 1024;  // between checks of the stream's state and the clock
    for (int64_t spins = 1; *published != tag; ++spins) {
        if (spins % kSpinsPerCheck != 0) continue;
        const cudaError_t state = cudaStreamQuery(stream);
        if (state != cudaSuccess && state != cudaErrorNotReady) {
            // A synchronizing call flushes what the device printed into stdout, and stdout is flushed (a pipe buffers,
            // and a spawned rank may end with os._exit). The error names peer and stage from the timeout record, which
            // survives the trap even when the printf buffer does not.
            cudaStreamSynchronize(stream);
            std::fflush(stdout);
            const std::string report = sync::timeout_report();
            TORCH_CHECK(false, report.empty() ? "" : report + "; ", "ep_dispatcher: rank ", buffer.rank(),
                        ": the stream faulted while the host waited for the count exchange: ", cudaGetErrorString(state));
        }
        if (state == cudaSuccess && *published != tag) break;  // cannot happen: the stream ran notify; re-read below
        const auto waited = std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start).count();
        TORCH_CHECK(waited < host_timeout_ns, "ep_dispatcher: timeout after ", host_timeout_ns / 1000000, " ms on rank ", buffer.rank(),
                    ", stage 'dispatch: host waiting for the count exchange'");
        std::this_thread::yield();
    }
    TORCH_CHECK(*published == tag, "ep_dispatcher: rank ", buffer.rank(), ": the count exchange finished without its report");
    std::atomic_thread_fence(std::memory_order_acquire);
}

// What the host takes from a count report: the count matrix (a host copy), and per rank the rows it receives and sends.
struct HostCounts {
    at::Tensor matrix;
    std::vector<int64_t> recv_rows;  // per receiver
    int64_t rows_out = 0, sent_rows = 0, most_rows = 0, most_sent = 0;  // this rank's, and the most of any rank
};
HostCounts host_counts(const intranode::CountReport& report, int R, int rank) {
    HostCounts c;
    c.matrix = at::from_blob(const_cast<int*>(report.count_matrix), {R, R}, at::TensorOptions().dtype(at::kInt)).clone();
    c.recv_rows.resize(R);
    for (int dst = 0; dst < R; ++dst) {
        int64_t rows = 0, sent = 0;
        for (int src = 0; src < R; ++src) {
            rows += report.count_matrix[src * R + dst];
            sent += report.count_matrix[dst * R + src];
        }
        c.recv_rows[dst] = rows;
        c.most_rows = std::max(c.most_rows, rows);
        c.most_sent = std::max(c.most_sent, sent);
        if (dst == rank) c.rows_out = rows, c.sent_rows = sent;
    }
    return c;
}

using FreshDispatchOutputs = std::tuple<at::Tensor, OptTensor, OptTensor, OptTensor, at::Tensor,  // recv x/scales/topk/weights/src
                                        at::Tensor, at::Tensor, at::Tensor, OptTensor,            // send_pos, counts, prefix, per expert
                                        OptTensor, std::vector<int64_t>, int64_t,                 // host counts, host list, rows
                                        int64_t, int64_t,   // rows this rank sent (combine gets them back), most any rank sent
                                        int64_t>;           // > 0: the pool bytes the call needs; it did not run (grow, retry)

// One C++ entry for a fresh dispatch, launched in one go: send positions and content checks, the count exchange
// (which also lays out every receiver's outputs in the pool block it published), the data kernel and its barrier.
// Only then does the host wait for the counts (host-mapped memory, no stream sync; not at all with num_worst_tokens),
// while the rows move, and makes the output tensors where the device put the rows. If some receiver's rows did not
// fit in its block (every rank sees the same), the data kernel did nothing and the data phase runs again in room
// made for it; if they do not fit even in some rank's empty pool, every rank returns the pool size the call needs
// instead, so that the caller grows the pools together and calls again.
FreshDispatchOutputs dispatch_fresh(IpcBuffer& buffer, const at::Tensor& x, const OptTensor& scales, const OptTensor& topk_idx,
                                    const OptTensor& topk_weights, const at::Tensor& is_token_in_rank,
                                    const at::Tensor& num_tokens_per_rank, const OptTensor& num_tokens_per_expert, int64_t num_experts,
                                    int64_t expert_alignment, int64_t num_worst_tokens, int64_t num_sms, int64_t timeout_ns) {
    TORCH_CHECK(buffer.is_open(), "intranode_dispatch: peers are not mapped");
    for (const auto& [t, name] :
         {std::pair{&x, "x"}, {&is_token_in_rank, "is_token_in_rank"}, {&num_tokens_per_rank, "num_tokens_per_rank"}})
        check_cuda(*t, name, buffer);
    const auto [x_row, scale_row, num_topk] = check_payload(buffer, x, scales, topk_idx, topk_weights);
    if (num_tokens_per_expert) check_cuda(*num_tokens_per_expert, "num_tokens_per_expert", buffer);
    const c10::cuda::CUDAGuard guard(x.device());
    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
    const int R = buffer.num_ranks(), rank = buffer.rank();
    const int num_tokens = static_cast<int>(x.size(0));
    const int num_local_experts = static_cast<int>(num_experts > 0 ? num_experts / R : 1);
    raise_unchecked_input_error(buffer, rank, num_experts);

    // The block the device lays this rank's outputs out in. With num_worst_tokens the size is known (room is made for
    // it: that may move earlier outputs, this call's inputs among them, out of the pool, so no data pointer is read
    // before this point). Otherwise the largest free region, as it is: evicting live outputs costs a copy, which a
    // call that fits does not need; one that does not fit runs its data phase again in room made for it.
    const bool worst = num_worst_tokens > 0;
    const intranode::ReceiveLayout worst_layout = intranode::receive_layout(num_worst_tokens, x_row, scale_row, num_topk, true);
    if (worst) check_receive_capacity(buffer, num_worst_tokens, x_row, scale_row, num_topk);
    RecvPool& pool = buffer.pool();
    const auto [block, block_bytes] = pool.take_block(worst ? worst_layout.end : 0, worst, stream);
    std::optional<ReceiveTensors> worst_out;  // known sizes: the tensors exist before the kernels (graph capture)
    if (worst) {
        worst_out = receive_tensors(pool, block, worst_layout, num_worst_tokens, x, scales, num_topk, true, stream);
        pool.end_block(worst_layout.end);
    }

    // One allocation for the small per-call state: counts [R] | count matrix [R, R] | prefix matrix [R, R] | per expert
    // | (8-byte aligned) the receivers' regions [R] | go.
    const int64_t num_per_expert = num_tokens_per_expert ? num_local_experts : 0;
    const int64_t plan_at = (R + 2 * R * R + num_per_expert + 1) / 2 * 2;
    const int64_t plan_ints = R * static_cast<int64_t>(sizeof(intranode::ReceiverRegions) / sizeof(int));
    at::Tensor ints = at::empty({plan_at + plan_ints + 1}, x.options().dtype(at::kInt));
    at::Tensor counts = ints.narrow(0, 0, R);
    at::Tensor count_matrix = ints.narrow(0, R, R * R).view({R, R});
    at::Tensor rank_prefix_matrix = ints.narrow(0, R + R * R, R * R).view({R, R});
    OptTensor recv_per_expert;
    if (num_tokens_per_expert) recv_per_expert = ints.narrow(0, R + 2 * R * R, num_per_expert);
    auto* plan = reinterpret_cast<intranode::ReceiverRegions*>(ints.data_ptr<int>() + plan_at);
    int* go = ints.data_ptr<int>() + plan_at + plan_ints;
    at::Tensor send_pos = at::empty({num_tokens, R}, x.options().dtype(at::kInt));

    // The count exchange (notify) runs in the send-position kernel's last block: one launch less.
    const int tag = buffer.next_report_tag();
    const intranode::NotifyArgs notify{buffer.peers(),
                                       rank,
                                       R,
                                       buffer.epoch(),
                                       /*num_tokens_per_rank=*/counts.data_ptr<int>(),
                                       num_tokens_per_expert ? num_tokens_per_expert->data_ptr<int>() : nullptr,
                                       static_cast<int>(num_experts),
                                       static_cast<int>(expert_alignment),
                                       /*pool_bytes=*/pool.capacity(),
                                       /*block_offset=*/block,
                                       block_bytes,
                                       /*block_rows=*/worst ? num_worst_tokens : -1,
                                       x_row,
                                       scale_row,
                                       num_topk,
                                       count_matrix.data_ptr<int>(),
                                       rank_prefix_matrix.data_ptr<int>(),
                                       recv_per_expert ? recv_per_expert->data_ptr<int>() : nullptr,
                                       plan,
                                       go,
                                       /*report=*/buffer.report_on_device(),
                                       /*report_tag=*/tag,
                                       timeout_ns,
                                       /*expert_table=*/nullptr};
    intranode::send_positions(buffer.peers(), rank, R, is_token_in_rank.data_ptr<bool>(), num_tokens, num_tokens_per_rank.data_ptr<int>(),
                              topk_idx ? topk_idx->data_ptr<int64_t>() : nullptr, num_topk, static_cast<int>(num_experts),
                              send_pos.data_ptr<int>(), counts.data_ptr<int>(), &notify, stream);
    intranode::dispatch(buffer.peers(), rank, R, x.data_ptr(), x_row, scales ? scales->data_ptr() : nullptr, scale_row,
                        topk_idx ? topk_idx->data_ptr<int64_t>() : nullptr, topk_weights ? topk_weights->data_ptr<float>() : nullptr,
                        num_topk, num_local_experts, is_token_in_rank.data_ptr<bool>(), send_pos.data_ptr<int>(),
                        count_matrix.data_ptr<int>(), plan, go, num_tokens, static_cast<int>(num_sms), stream, R == 1);
    // Past this barrier every peer has read this call's counts, block and input error: the error can be cleared. One
    // rank has no barrier to wait for (its dispatch kernel cleared the error).
    intranode::barrier(buffer.peers(), rank, R, buffer.epoch(), timeout_ns, sync::kStageDispatchData, nullptr, stream, R > 1);

    // Without the counts on the host (num_worst_tokens), a bound: each token goes to at most min(R, num_topk) ranks.
    int64_t sent_rows = static_cast<int64_t>(num_tokens) * (topk_idx ? std::min(R, num_topk) : R), most_sent = sent_rows;
    if (worst) {
        intranode::mark_padding(count_matrix.data_ptr<int>(), rank, R, static_cast<int>(num_worst_tokens), worst_out->src.data_ptr<int>(),
                                worst_out->topk ? worst_out->topk->data_ptr<int64_t>() : nullptr,
                                worst_out->weights ? worst_out->weights->data_ptr<float>() : nullptr, num_topk, stream);
        buffer.unchecked_report_tag = tag;
        return {worst_out->x, worst_out->scales, worst_out->topk, worst_out->weights, worst_out->src, send_pos, count_matrix,
                rank_prefix_matrix, recv_per_expert, std::nullopt, {}, num_worst_tokens, sent_rows, most_sent, 0};
    }

    wait_for_report(buffer, tag, stream, timeout_ns);
    const intranode::CountReport& report = *buffer.report();
    if (report.error.code != intranode::kInputOk) {
        pool.end_block(0);
        raise_input_error(report.error, rank, num_experts);
    }
    const HostCounts host = host_counts(report, R, rank);
    at::Tensor count_matrix_host = host.matrix;
    const int64_t rows_out = host.rows_out, most = host.most_rows;
    sent_rows = host.sent_rows;
    most_sent = host.most_sent;
    std::vector<int64_t> per_expert_list(report.recv_per_expert, report.recv_per_expert + num_per_expert);
    const intranode::ReceiveLayout layout = intranode::receive_layout(rows_out, x_row, scale_row, num_topk, true);
    if (report.fits) {
        ReceiveTensors out = receive_tensors(pool, block, layout, rows_out, x, scales, num_topk, true, stream);
        pool.end_block(layout.end);
        return {out.x, out.scales, out.topk, out.weights, out.src, send_pos, count_matrix, rank_prefix_matrix, recv_per_expert,
                count_matrix_host, per_expert_list, rows_out, sent_rows, most_sent, 0};
    }
    // Some receiver's block was too small: nothing moved. Every rank sees the same counts and the same smallest pool of
    // the group, so all take the same branch. A pool that cannot hold two such calls' outputs grows (to twice this
    // call's, collectively): a loop that keeps its last outputs alive would otherwise evict them on every call.
    pool.end_block(0);
    ++buffer.dispatch_reruns;
    const int64_t needed = intranode::dispatch_bytes(most, x_row, scale_row, num_topk, true);
    if (2 * needed > report.min_pool_bytes)
        return {x, std::nullopt, std::nullopt, std::nullopt, send_pos, send_pos, count_matrix, rank_prefix_matrix, std::nullopt,
                std::nullopt, {}, -1, 0, 0, needed};
    auto [recv_x, recv_scales, recv_topk, recv_weights, recv_src] =
        dispatch(buffer, x, scales, topk_idx, topk_weights, num_local_experts, is_token_in_rank, send_pos, count_matrix, rows_out, num_sms,
                 timeout_ns, true);
    return {recv_x, recv_scales, recv_topk, recv_weights, recv_src, send_pos, count_matrix, rank_prefix_matrix, recv_per_expert,
            count_matrix_host, per_expert_list, rows_out, sent_rows, most_sent, 0};
}

// ------------------------------------------------------------------ expert-major dispatch (fused permute)
using ExpertMajorOutputs = std::tuple<OptTensor, OptTensor, OptTensor, OptTensor, OptTensor,  // x/scales (expert-major), topk/weights/src
                                      OptTensor, OptTensor,                                 // row map [rows, k], row pair [M] (int64)
                                      at::Tensor, at::Tensor, at::Tensor, at::Tensor,       // send_pos, pairs [2, N, k], counts, prefix
                                      at::Tensor, at::Tensor,                               // per expert (aligned) [L], expert table
                                      OptTensor, std::vector<int64_t>, int64_t, int64_t,    // host counts, host list, rows, M
                                      int64_t, int64_t, int64_t>;  // rows sent, most any rank sent, > 0: pool bytes needed (grow, retry)

// One C++ entry for a fresh expert-major dispatch (docs/fused_permute.md): send positions, per-expert pair positions and
// content checks, the count exchange (which also computes each expert's slot base on every receiver), then the host
// waits for the counts (the fresh dispatch's one wait, host-mapped memory), takes the block the outputs need (its size
// depends on the expert-major row count M, known only now), publishes it at a barrier, and the senders write every
// (token, local expert) row straight to its expert-major row; each receiver zeroes its padding rows. If the group's
// smallest pool cannot hold two such calls' outputs for the rank that needs most, every rank returns that size instead
// (same counts, same smallest pool: all alike), so that the caller grows the pools together and calls again.
ExpertMajorOutputs dispatch_expert_major_fresh(IpcBuffer& buffer, const at::Tensor& x, const OptTensor& scales, const at::Tensor& topk_idx,
                                               const at::Tensor& topk_weights, const at::Tensor& is_token_in_rank,
                                               const at::Tensor& num_tokens_per_rank, int64_t num_experts, int64_t expert_alignment,
                                               int64_t num_sms, int64_t timeout_ns) {
    TORCH_CHECK(buffer.is_open(), "intranode_dispatch_expert_major: peers are not mapped");
    for (const auto& [t, name] :
         {std::pair{&x, "x"}, {&is_token_in_rank, "is_token_in_rank"}, {&num_tokens_per_rank, "num_tokens_per_rank"}})
        check_cuda(*t, name, buffer);
    const auto [x_row, scale_row, num_topk] = check_payload(buffer, x, scales, topk_idx, topk_weights);
    const c10::cuda::CUDAGuard guard(x.device());
    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
    const int R = buffer.num_ranks(), rank = buffer.rank();
    TORCH_CHECK_VALUE(num_experts > 0 && num_experts % R == 0 && num_experts <= intranode::kMaxExperts,
                      "num_experts: expected a multiple of ", R, " up to ", intranode::kMaxExperts, ", got ", num_experts);
    TORCH_CHECK_VALUE(expert_alignment >= 1, "expert_alignment: expected >= 1, got ", expert_alignment);
    TORCH_CHECK_VALUE(num_topk >= 1, "topk_idx: expected at least one column");
    const int E = static_cast<int>(num_experts), L = E / R;
    const int num_tokens = static_cast<int>(x.size(0));
    raise_unchecked_input_error(buffer, rank, num_experts);

    // One allocation for the small per-call state: counts [R] | count matrix [R, R] | prefix matrix [R, R] | received
    // per local expert, aligned [L] | this rank's pairs per expert [E] | notify's expert table.
    const int64_t table_ints = intranode::expert_table_ints(E, L);
    at::Tensor ints = at::empty({R + 2 * R * R + L + E + table_ints}, x.options().dtype(at::kInt));
    at::Tensor counts = ints.narrow(0, 0, R);
    at::Tensor count_matrix = ints.narrow(0, R, R * R).view({R, R});
    at::Tensor rank_prefix_matrix = ints.narrow(0, R + R * R, R * R).view({R, R});
    at::Tensor per_expert = ints.narrow(0, R + 2 * R * R, L);
    at::Tensor expert_counts = ints.narrow(0, R + 2 * R * R + L, E);
    at::Tensor expert_table = ints.narrow(0, R + 2 * R * R + L + E, table_ints);
    int* slot_base = expert_table.data_ptr<int>() + E;
    int* recv_pairs = expert_table.data_ptr<int>() + 2 * E;
    at::Tensor send_pos = at::empty({num_tokens, R}, x.options().dtype(at::kInt));
    at::Tensor pairs = at::empty({2, num_tokens, num_topk}, x.options().dtype(at::kInt));

    intranode::send_positions(buffer.peers(), rank, R, is_token_in_rank.data_ptr<bool>(), num_tokens, num_tokens_per_rank.data_ptr<int>(),
                              topk_idx.data_ptr<int64_t>(), num_topk, E, send_pos.data_ptr<int>(), counts.data_ptr<int>(), nullptr, stream);
    // The pair counts published are the ones the positions come from (not the caller's num_tokens_per_expert), so the
    // slots cannot overrun whatever the caller passed.
    intranode::expert_positions(topk_idx.data_ptr<int64_t>(), is_token_in_rank.data_ptr<bool>(), num_tokens, num_topk, E, R,
                                pairs.data_ptr<int>(), expert_counts.data_ptr<int>(), stream);
    const int tag = buffer.next_report_tag();
    RecvPool& pool = buffer.pool();
    // No block, plan or go: the block is taken once the host has the counts (below).
    intranode::notify({buffer.peers(), rank, R, buffer.epoch(), counts.data_ptr<int>(), expert_counts.data_ptr<int>(), E,
                       static_cast<int>(expert_alignment), pool.capacity(), /*block_offset=*/-1, /*block_bytes=*/0,
                       /*block_rows=*/-1, x_row, scale_row, num_topk, count_matrix.data_ptr<int>(), rank_prefix_matrix.data_ptr<int>(),
                       per_expert.data_ptr<int>(), /*plan=*/nullptr, /*go=*/nullptr, buffer.report_on_device(), tag, timeout_ns,
                       expert_table.data_ptr<int>()},
                      stream);
    wait_for_report(buffer, tag, stream, timeout_ns);
    const intranode::CountReport& report = *buffer.report();
    // Ends the call on every path: past it every peer has read this call's counts and input error (cleared then).
    const auto close = [&] {
        intranode::barrier(buffer.peers(), rank, R, buffer.epoch(), timeout_ns, sync::kStageDispatchData, nullptr, stream, true);
    };
    if (report.error.code != intranode::kInputOk) {
        close();
        raise_input_error(report.error, rank, num_experts);
    }
    const HostCounts host = host_counts(report, R, rank);
    const int64_t num_rows = report.expert_rows[rank];
    int64_t most_needed = 0;
    for (int d = 0; d < R; ++d) {
        const int64_t rows = host.recv_rows[d], expert_rows = report.expert_rows[d];
        const int64_t bytes = intranode::expert_major_receive_layout(rows, expert_rows, x_row, scale_row, num_topk, true).end;
        most_needed = std::max(most_needed, bytes);
    }
    std::vector<int64_t> per_expert_list(report.recv_per_expert, report.recv_per_expert + L);
    if (2 * most_needed > report.min_pool_bytes) {
        close();
        return {std::nullopt, std::nullopt, std::nullopt,       std::nullopt, std::nullopt, std::nullopt, std::nullopt,
                send_pos,     pairs,        count_matrix,       rank_prefix_matrix, per_expert, expert_table, std::nullopt,
                {},           -1,           -1,                 0,            0,            most_needed};
    }

    // Room first: making it may move earlier outputs (this call's inputs among them) out of the pool, so the data
    // pointers of the inputs are read only after this point.
    const intranode::ExpertMajorReceiveLayout layout =
        intranode::expert_major_receive_layout(host.rows_out, num_rows, x_row, scale_row, num_topk, true);
    const int64_t block = pool.take_block(layout.end, true, stream).first;
    at::Tensor recv_x = pool.tensor_at(block + layout.x, {num_rows, x.size(1)}, x.scalar_type(), stream);
    OptTensor recv_scales;
    if (scales) recv_scales = pool.tensor_at(block + layout.scales, {num_rows, scales->size(1)}, scales->scalar_type(), stream);
    at::Tensor recv_topk = pool.tensor_at(block + layout.order.topk, {host.rows_out, num_topk}, at::kLong, stream);
    at::Tensor recv_weights = pool.tensor_at(block + layout.order.weights, {host.rows_out, num_topk}, at::kFloat, stream);
    at::Tensor recv_src = pool.tensor_at(block + layout.order.src, {host.rows_out}, at::kInt, stream);
    at::Tensor row_map = pool.tensor_at(block + layout.row_map, {host.rows_out, num_topk}, at::kLong, stream);
    at::Tensor row_pair = pool.tensor_at(block + layout.row_pair, {num_rows}, at::kLong, stream);
    pool.end_block(layout.end);

    intranode::Published publish = nothing_published();
    publish.value[intranode::kPubRecvX] = block + layout.x;
    if (scales) publish.value[intranode::kPubRecvScales] = block + layout.scales;
    publish.value[intranode::kPubRecvTopk] = block + layout.order.topk;
    publish.value[intranode::kPubRecvWeights] = block + layout.order.weights;
    publish.value[intranode::kPubRecvSrc] = block + layout.order.src;
    publish.value[intranode::kPubRecvRows] = host.rows_out;
    publish.value[intranode::kPubRecvRowMap] = block + layout.row_map;
    publish.value[intranode::kPubRecvRowPair] = block + layout.row_pair;
    publish.value[intranode::kPubRecvExpertRows] = num_rows;
    intranode::barrier(buffer.peers(), rank, R, buffer.epoch(), timeout_ns, sync::kStageDispatchReady, &publish, stream);
    intranode::dispatch_expert_major(buffer.peers(), rank, R, x.data_ptr(), x_row, scales ? scales->data_ptr() : nullptr, scale_row,
                                     topk_idx.data_ptr<int64_t>(), topk_weights.data_ptr<float>(), num_topk, L,
                                     is_token_in_rank.data_ptr<bool>(), send_pos.data_ptr<int>(), count_matrix.data_ptr<int>(), slot_base,
                                     pairs.data_ptr<int>(), num_tokens, static_cast<int>(num_sms), stream);
    intranode::expert_major_padding(per_expert.data_ptr<int>(), recv_pairs, L, recv_x.data_ptr(), x_row,
                                    recv_scales ? recv_scales->data_ptr() : nullptr, scale_row, row_pair.data_ptr<int64_t>(), stream);
    close();
    return {recv_x, recv_scales, recv_topk, recv_weights, recv_src, row_map, row_pair, send_pos, pairs, count_matrix, rank_prefix_matrix,
            per_expert, expert_table, host.matrix, per_expert_list, host.rows_out, num_rows, host.sent_rows, host.most_sent, 0};
}

// A cached expert-major dispatch (combine's backward): the data phase only, with the fresh call's (row, destination) of
// every pair; x and scales land in expert-major rows, padding rows zeroed by each receiver.
std::tuple<at::Tensor, OptTensor> dispatch_expert_major_cached(IpcBuffer& buffer, const at::Tensor& x, const OptTensor& scales,
                                                               const at::Tensor& pairs, const at::Tensor& per_expert,
                                                               const at::Tensor& expert_table, int64_t num_rows, int64_t num_sms,
                                                               int64_t timeout_ns) {
    TORCH_CHECK(buffer.is_open(), "intranode_dispatch_expert_major: peers are not mapped");
    for (const auto& [t, name] :
         {std::pair{&x, "x"}, {&pairs, "pairs"}, {&per_expert, "per_expert"}, {&expert_table, "expert_table"}})
        check_cuda(*t, name, buffer);
    const auto [x_row, scale_row, no_topk] = check_payload(buffer, x, scales, std::nullopt, std::nullopt);
    TORCH_CHECK_VALUE(pairs.dim() == 3 && pairs.size(0) == 2 && pairs.size(1) == x.size(0), "x: the handle was made for ", pairs.size(1),
                      " tokens, got ", x.size(0));
    const c10::cuda::CUDAGuard guard(x.device());
    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
    const int R = buffer.num_ranks(), rank = buffer.rank();
    const int num_topk = static_cast<int>(pairs.size(2));
    const int L = static_cast<int>(per_expert.size(0));
    const int64_t E = (expert_table.numel() - L) / 2;
    const intranode::ExpertMajorReceiveLayout layout = intranode::expert_major_receive_layout(0, num_rows, x_row, scale_row, 0, false);
    RecvPool& pool = buffer.pool();
    TORCH_CHECK_VALUE(layout.end <= pool.capacity(), "num_nvl_bytes: the buffer holds ", pool.capacity(), " bytes, this dispatch needs ",
                      layout.end, "; create the Buffer with more num_nvl_bytes");

    // Room first (it may move earlier outputs, x among them, out of the pool): no data pointer is read before.
    const int64_t block = pool.take_block(layout.end, true, stream).first;
    at::Tensor recv_x = pool.tensor_at(block + layout.x, {num_rows, x.size(1)}, x.scalar_type(), stream);
    OptTensor recv_scales;
    if (scales) recv_scales = pool.tensor_at(block + layout.scales, {num_rows, scales->size(1)}, scales->scalar_type(), stream);
    pool.end_block(layout.end);
    intranode::Published publish = nothing_published();
    publish.value[intranode::kPubRecvX] = block + layout.x;
    if (scales) publish.value[intranode::kPubRecvScales] = block + layout.scales;
    publish.value[intranode::kPubRecvExpertRows] = num_rows;
    intranode::barrier(buffer.peers(), rank, R, buffer.epoch(), timeout_ns, sync::kStageDispatchReady, &publish, stream);
    // Cached: no top-k, no received-order fields; the kernel only reads the pair table (it writes it on a fresh call).
    intranode::dispatch_expert_major(buffer.peers(), rank, R, x.data_ptr(), x_row, scales ? scales->data_ptr() : nullptr, scale_row,
                                     nullptr, nullptr, num_topk, L, nullptr, nullptr, nullptr, nullptr,
                                     const_cast<int*>(pairs.data_ptr<int>()), static_cast<int>(x.size(0)), static_cast<int>(num_sms),
                                     stream);
    intranode::expert_major_padding(per_expert.data_ptr<int>(), expert_table.data_ptr<int>() + 2 * E, L, recv_x.data_ptr(), x_row,
                                    recv_scales ? recv_scales->data_ptr() : nullptr, scale_row, nullptr, stream);
    intranode::barrier(buffer.peers(), rank, R, buffer.epoch(), timeout_ns, sync::kStageDispatchData, nullptr, stream);
    return {recv_x, recv_scales};
}

// Combine: this rank takes a transient region of its pool for the rows coming back (sent_rows of them: the rows it
// sent in the dispatch, or a bound of them), publishes it at a barrier, peers write the rows there, and it sums them.
// With `row_map` (a fused expert-major dispatch's, [received rows, top-k] int64) x is [M, hidden] expert-major: every
// rank pushes (no pull: the sources would have to read the row maps and sum twice), each row it sends is the sum of
// the token's expert-major rows (fused un-permute), and its own rows go to its own region like a peer's.
std::tuple<at::Tensor, OptTensor> combine(IpcBuffer& buffer, const at::Tensor& x, const OptTensor& topk_weights, const OptTensor& bias0,
                                          const OptTensor& bias1, const at::Tensor& is_token_in_rank, const at::Tensor& send_pos,
                                          const at::Tensor& count_matrix, int64_t num_tokens, int64_t sent_rows, int64_t num_sms,
                                          int64_t timeout_ns, const OptTensor& row_map) {
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
    if (row_map) {
        check_cuda(*row_map, "row_map", buffer);
        TORCH_CHECK_VALUE(row_map->dim() == 2 && row_map->scalar_type() == at::kLong && row_map->size(1) <= kMaxTopk,
                          "row_map: expected [num_recv_tokens, num_topk <= ", kMaxTopk, "] int64, got ", row_map->sizes(), " ",
                          row_map->scalar_type());
        TORCH_CHECK_VALUE(!topk_weights || topk_weights->size(0) == row_map->size(0), "topk_weights: expected ", row_map->size(0),
                          " rows (received order), got ", topk_weights->size(0));
    }
    const int capacity = intranode::combine_capacity(buffer.pool().capacity(), x_row, num_topk);
    TORCH_CHECK_VALUE(sent_rows <= capacity, "num_nvl_bytes: the buffer holds ", capacity,
                      " returned rows of this shape, this combine needs ", sent_rows, "; create the Buffer with more num_nvl_bytes");

    // Room first (it may move earlier outputs, x among them, out of the pool): no data pointer is read before.
    RecvPool& pool = buffer.pool();
    // The input stays in the pool if other outputs can make the room: then it is read in place (pull), not pushed.
    pool.reserve(intranode::combine_bytes(sent_rows, x_row, num_topk), stream,
                 {x.data_ptr(), topk_weights ? topk_weights->data_ptr() : nullptr, row_map ? row_map->data_ptr() : nullptr});
    const int64_t x_offset = pool.transient(sent_rows * x_row, stream);
    const int64_t weights_offset = num_topk > 0 ? pool.transient(sent_rows * num_topk * static_cast<int64_t>(sizeof(float)), stream) : -1;
    intranode::Published publish = nothing_published();
    publish.value[intranode::kPubCombineX] = x_offset;
    publish.value[intranode::kPubCombineWeights] = weights_offset;
    publish.value[intranode::kPubCombineRows] = sent_rows;
    // An input that lies in the pool (with its weights, if any) is read by the sources where it is: no push pass.
    const bool pulled = !row_map && pool.holds(x) && (!topk_weights || pool.holds(*topk_weights));
    if (pulled) {
        publish.value[intranode::kPubCombineInputX] = pool.offset_of(x);
        if (topk_weights) publish.value[intranode::kPubCombineInputWeights] = pool.offset_of(*topk_weights);
    }

    intranode::barrier(buffer.peers(), buffer.rank(), R, buffer.epoch(), timeout_ns, sync::kStageCombineReady, &publish, stream);
    if (row_map)
        intranode::combine_send_expert_major(buffer.peers(), buffer.rank(), R, x.data_ptr(), x.size(0), hidden, float_type_of(x),
                                             row_map->data_ptr<int64_t>(), static_cast<int>(row_map->size(1)),
                                             topk_weights ? topk_weights->data_ptr<float>() : nullptr, num_topk,
                                             count_matrix.data_ptr<int>(), static_cast<int>(num_sms), stream);
    else if (!pulled)
        intranode::combine_send(buffer.peers(), buffer.rank(), R, x.data_ptr(), x_row,
                                topk_weights ? topk_weights->data_ptr<float>() : nullptr, num_topk, count_matrix.data_ptr<int>(),
                                static_cast<int>(num_sms), stream);
    intranode::barrier(buffer.peers(), buffer.rank(), R, buffer.epoch(), timeout_ns, sync::kStageCombineData, nullptr, stream);

    at::Tensor out = at::empty({num_tokens, hidden}, x.options());
    OptTensor out_weights;
    if (topk_weights) out_weights = at::empty({num_tokens, num_topk}, topk_weights->options());
    intranode::combine_reduce(buffer.peers(), buffer.local_data() + x_offset,
                              weights_offset >= 0 ? reinterpret_cast<const float*>(buffer.local_data() + weights_offset) : nullptr,
                              row_map ? nullptr : x.data_ptr(), row_map || !topk_weights ? nullptr : topk_weights->data_ptr<float>(),
                              buffer.rank(), R,
                              count_matrix.data_ptr<int>(), is_token_in_rank.data_ptr<bool>(), send_pos.data_ptr<int>(),
                              static_cast<int>(num_tokens), hidden,
                              float_type_of(x),
                              bias0 ? bias0->data_ptr() : nullptr, bias1 ? bias1->data_ptr() : nullptr, out.data_ptr(),
                              out_weights ? out_weights->data_ptr<float>() : nullptr, num_topk, static_cast<int>(num_sms), stream);
    // Peers may be reading this rank's input until they pass this point (every rank waits, as they cannot know).
    intranode::barrier(buffer.peers(), buffer.rank(), R, buffer.epoch(), timeout_ns, sync::kStageCombineDone, nullptr, stream);
    pool.release_transient(x_offset, stream);
    if (weights_offset >= 0) pool.release_transient(weights_offset, stream);
    return {out, out_weights};
}

}  // namespace

void register_intranode(py::module_& m) {
    py::class_<IpcBuffer>(m, "IpcBuffer", "One rank's CUDA-IPC buffer (signal area + data area) and its peers' mappings.")
        .def(py::init<int, int, int64_t, int>(), py::arg("rank"), py::arg("num_ranks"), py::arg("num_data_bytes"), py::arg("device"))
        .def("ipc_handle", [](const IpcBuffer& b) { return py::bytes(b.ipc_handle()); })
        .def(
            "open_peers",
            [](IpcBuffer& b, const std::vector<py::bytes>& handles) {
                std::vector<std::string> raw(handles.begin(), handles.end());
                b.open_peers(raw);
            },
            py::arg("handles"))
        .def("destroy", &IpcBuffer::destroy)
        .def_property_readonly("data_bytes", &IpcBuffer::data_bytes)
        .def_property_readonly("dispatch_reruns", [](const IpcBuffer& b) { return b.dispatch_reruns; },
                               "Fresh dispatches whose data phase ran again because a receiver's rows did not fit where the "
                               "count exchange laid them out (it then made room by evicting older outputs).")
        .def("dispatch_capacity",
             [](const IpcBuffer& b, int x_row_bytes, int scale_row_bytes, int num_topk) {
                 return intranode::dispatch_capacity(b.pool().capacity(), x_row_bytes, scale_row_bytes, num_topk);
             },
             py::arg("x_row_bytes"), py::arg("scale_row_bytes"), py::arg("num_topk"))
        .def("combine_capacity",
             [](const IpcBuffer& b, int x_row_bytes, int num_topk) {
                 return intranode::combine_capacity(b.pool().capacity(), x_row_bytes, num_topk);
             },
             py::arg("x_row_bytes"), py::arg("num_topk"))
        .def("poison_receive_pool", [](IpcBuffer& b, bool on) { b.pool().set_poison(on); }, py::arg("on"),
             "Tests: fill every new receive region with 0xff, so rows a kernel fails to write show up.");
    m.attr("INTRANODE_SIGNAL_BYTES") = static_cast<int64_t>(intranode::kSignalBytes);
    m.def("intranode_combine_bytes", &intranode::combine_bytes, py::arg("rows"), py::arg("x_row_bytes"), py::arg("num_topk"),
          "Receive-pool bytes a combine of `rows` returned rows takes.");
    m.attr("INTRANODE_MAX_RANKS") = intranode::kMaxRanks;
    m.attr("INTRANODE_MAX_EXPERTS") = intranode::kMaxExperts;
    m.def("intranode_dispatch_fresh", &dispatch_fresh, py::arg("buffer"), py::arg("x"), py::arg("scales"), py::arg("topk_idx"),
          py::arg("topk_weights"), py::arg("is_token_in_rank"), py::arg("num_tokens_per_rank"), py::arg("num_tokens_per_expert"),
          py::arg("num_experts"), py::arg("expert_alignment"), py::arg("num_worst_tokens"), py::arg("num_sms"), py::arg("timeout_ns"),
          py::call_guard<py::gil_scoped_release>());
    m.def("intranode_dispatch", &dispatch, py::arg("buffer"), py::arg("x"), py::arg("scales"), py::arg("topk_idx"), py::arg("topk_weights"),
          py::arg("num_local_experts"), py::arg("is_token_in_rank"), py::arg("send_pos"), py::arg("count_matrix"), py::arg("rows_out"),
          py::arg("num_sms"), py::arg("timeout_ns"), py::arg("fresh"), py::call_guard<py::gil_scoped_release>());
    m.def("intranode_dispatch_expert_major", &dispatch_expert_major_fresh, py::arg("buffer"), py::arg("x"), py::arg("scales"),
          py::arg("topk_idx"), py::arg("topk_weights"), py::arg("is_token_in_rank"), py::arg("num_tokens_per_rank"), py::arg("num_experts"),
          py::arg("expert_alignment"), py::arg("num_sms"), py::arg("timeout_ns"), py::call_guard<py::gil_scoped_release>());
    m.def("intranode_dispatch_expert_major_cached", &dispatch_expert_major_cached, py::arg("buffer"), py::arg("x"), py::arg("scales"),
          py::arg("pairs"), py::arg("per_expert"), py::arg("expert_table"), py::arg("num_rows"), py::arg("num_sms"), py::arg("timeout_ns"),
          py::call_guard<py::gil_scoped_release>());
    m.def("intranode_combine", &combine, py::arg("buffer"), py::arg("x"), py::arg("topk_weights"), py::arg("bias0"), py::arg("bias1"),
          py::arg("is_token_in_rank"), py::arg("send_pos"), py::arg("count_matrix"), py::arg("num_tokens"), py::arg("sent_rows"),
          py::arg("num_sms"), py::arg("timeout_ns"), py::arg("row_map") = py::none(), py::call_guard<py::gil_scoped_release>());
}

}  // namespace ep
