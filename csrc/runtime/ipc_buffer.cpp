#include "ipc_buffer.h"

#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>

#include <cstring>

#include "../kernels/common.cuh"
#include "timeout_record.h"

namespace ep {

IpcBuffer::IpcBuffer(int rank, int num_ranks, int64_t num_data_bytes, int device)
    : rank_(rank), num_ranks_(num_ranks), device_(device), data_bytes_(num_data_bytes) {
    EP_HOST_ASSERT(num_ranks >= 1 && num_ranks <= intranode::kMaxRanks, "num_ranks must be in [1, ", intranode::kMaxRanks, "], got ",
                   num_ranks);
    EP_HOST_ASSERT(rank >= 0 && rank < num_ranks, "rank must be in [0, num_ranks), got ", rank);
    EP_HOST_ASSERT(num_data_bytes >= 0, "num_nvl_bytes must be >= 0, got ", num_data_bytes);
    EP_CUDA_CHECK(cudaSetDevice(device));
    sync::install_timeout_record(device);
    const size_t total = intranode::kSignalBytes + static_cast<size_t>(num_data_bytes);
    EP_CUDA_CHECK(cudaMalloc(&base_, total));
    // Flags start at 0 and epochs at 1, so no barrier can pass on stale memory.
    EP_CUDA_CHECK(cudaMemset(base_, 0, intranode::kSignalBytes));
    EP_CUDA_CHECK(cudaMalloc(&epoch_, sizeof(int)));
    EP_CUDA_CHECK(cudaMemset(epoch_, 0, sizeof(int)));
    // Written by the notify kernel, polled by the host: mapped pinned memory needs no copy and no stream sync.
    EP_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&report_), sizeof(intranode::CountReport), cudaHostAllocMapped));
    std::memset(report_, 0, sizeof(intranode::CountReport));
    EP_CUDA_CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&report_device_), report_, 0));
    EP_CUDA_CHECK(cudaDeviceSynchronize());
    mapped_.assign(num_ranks, false);
    pool_ = std::make_shared<RecvPool>(base_ + intranode::kSignalBytes, num_data_bytes, device);
}

IpcBuffer::~IpcBuffer() {
    try {
        destroy();
    } catch (...) {
        // Destructors must not throw; an explicit destroy() reports errors.
    }
}

std::string IpcBuffer::ipc_handle() const {
    EP_HOST_ASSERT(!destroyed_, "the buffer was destroyed");
    cudaIpcMemHandle_t handle;
    EP_CUDA_CHECK(cudaIpcGetMemHandle(&handle, base_));
    return std::string(reinterpret_cast<const char*>(&handle), sizeof(handle));
}

void IpcBuffer::open_peers(const std::vector<std::string>& handles) {
    EP_HOST_ASSERT(!destroyed_, "the buffer was destroyed");
    EP_HOST_ASSERT(!opened_, "open_peers was already called");
    EP_HOST_ASSERT(static_cast<int>(handles.size()) == num_ranks_, "expected ", num_ranks_, " handles, got ", handles.size());
    EP_CUDA_CHECK(cudaSetDevice(device_));
    for (int r = 0; r < num_ranks_; ++r) {
        if (r == rank_) {
            peers_.base[r] = base_;
            continue;
        }
        EP_HOST_ASSERT(handles[r].size() == sizeof(cudaIpcMemHandle_t), "handle of rank ", r, " has ", handles[r].size(), " bytes");
        cudaIpcMemHandle_t handle;
        std::memcpy(&handle, handles[r].data(), sizeof(handle));
        void* ptr = nullptr;
        EP_CUDA_CHECK(cudaIpcOpenMemHandle(&ptr, handle, cudaIpcMemLazyEnablePeerAccess));
        peers_.base[r] = static_cast<char*>(ptr);
        mapped_[r] = true;
    }
    opened_ = true;
}

void IpcBuffer::destroy() {
    if (destroyed_) return;
    destroyed_ = true;
    cudaSetDevice(device_);
    // Outputs still alive move to memory of their own before the pool's memory goes away.
    if (pool_) pool_->evict_all(c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device_)).stream());
    pool_.reset();
    cudaDeviceSynchronize();  // no kernel may still touch the memory
    for (int r = 0; r < num_ranks_; ++r)
        if (mapped_[r]) EP_CUDA_CHECK(cudaIpcCloseMemHandle(peers_.base[r]));
    if (base_ != nullptr) EP_CUDA_CHECK(cudaFree(base_));
    if (epoch_ != nullptr) EP_CUDA_CHECK(cudaFree(epoch_));
    if (report_ != nullptr) EP_CUDA_CHECK(cudaFreeHost(report_));
    base_ = nullptr;
    epoch_ = nullptr;
    report_ = nullptr;
    report_device_ = nullptr;
}

}  // namespace ep
