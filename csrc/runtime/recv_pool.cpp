#include "recv_pool.h"

#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>

#include "../kernels/common.cuh"

namespace ep {

RecvPool::RecvPool(char* base, int64_t bytes, int device) : base_(base), bytes_(bytes / kAlignment * kAlignment), device_(device) {
    if (bytes_ > 0) free_[0] = bytes_;
}

RecvPool::~RecvPool() {
    for (cudaEvent_t e : events_) cudaEventDestroy(e);
}

bool RecvPool::capturing(cudaStream_t stream) {
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    EP_CUDA_CHECK(cudaStreamIsCapturing(stream, &status));
    return status != cudaStreamCaptureStatusNone;
}

std::map<int64_t, int64_t>::const_iterator RecvPool::largest_free_block_locked() const {
    auto largest = free_.end();
    for (auto it = free_.begin(); it != free_.end(); ++it)
        if (largest == free_.end() || it->second > largest->second) largest = it;
    return largest;
}

int64_t RecvPool::largest_free_locked() const {
    const auto largest = largest_free_block_locked();
    return largest == free_.end() ? 0 : largest->second;
}

int64_t RecvPool::allocate_locked(int64_t bytes) {
    for (auto it = free_.begin(); it != free_.end(); ++it) {
        if (it->second < bytes) continue;
        const int64_t offset = it->first, left = it->second - bytes;
        free_.erase(it);
        if (left > 0) free_[offset + bytes] = left;
        return offset;
    }
    return -1;
}

void RecvPool::free_locked(int64_t offset, int64_t bytes) {
    auto next = free_.lower_bound(offset);
    if (next != free_.end() && offset + bytes == next->first) {  // merge with the following free block
        bytes += next->second;
        next = free_.erase(next);
    }
    if (next != free_.begin()) {
        auto prev = std::prev(next);
        if (prev->first + prev->second == offset) {  // merge with the preceding free block
            prev->second += bytes;
            return;
        }
    }
    free_[offset] = bytes;
}

void RecvPool::settle_locked(cudaStream_t stream) {
    // One cross-stream wait per stream that freed something: reuse must not overtake the last use.
    std::vector<cudaStream_t> waited;
    for (const Freed& f : pending_) {
        if (f.stream != stream && std::find(waited.begin(), waited.end(), f.stream) == waited.end()) {
            if (waited.size() == events_.size()) {
                cudaEvent_t e;
                EP_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
                events_.push_back(e);
            }
            cudaEvent_t e = events_[waited.size()];
            EP_CUDA_CHECK(cudaEventRecord(e, f.stream));
            EP_CUDA_CHECK(cudaStreamWaitEvent(stream, e, 0));
            waited.push_back(f.stream);
        }
        free_locked(f.offset, f.bytes);
    }
    pending_.clear();
}

bool RecvPool::evict_oldest_locked(cudaStream_t stream, std::unique_lock<std::mutex>& lock, const std::vector<const void*>& keep) {
    for (auto it = live_.begin(); it != live_.end(); ++it) {
        if (!it->evictable || !it->storage) continue;
        const char *begin = base_ + it->offset, *end = begin + it->bytes;
        if (std::any_of(keep.begin(), keep.end(), [&](const void* p) { return p >= begin && p < end; })) continue;
        c10::intrusive_ptr<c10::StorageImpl> storage = it->storage->lock();
        if (!storage) continue;  // its tensor is being freed right now; the deleter gives the region back
        const int64_t offset = it->offset, bytes = it->bytes;
        at::DataPtr moved = c10::cuda::CUDACachingAllocator::get()->allocate(bytes);
        EP_CUDA_CHECK(cudaMemcpyAsync(moved.get(), base_ + offset, bytes, cudaMemcpyDeviceToDevice, stream));
        it->evictable = false;  // not twice
        at::DataPtr old = storage->set_data_ptr(std::move(moved));
        // Dropping the old pointer runs the deleter, which takes the lock and queues the region on the current stream,
        // the stream of the copy above.
        lock.unlock();
        { at::DataPtr drop = std::move(old); }
        storage.reset();
        lock.lock();
        return true;
    }
    return false;
}

// Evicts the oldest outputs until a free region of `bytes` exists. Not strict: stops when nothing is left to evict.
void RecvPool::make_room_locked(int64_t bytes, cudaStream_t stream, std::unique_lock<std::mutex>& lock, bool strict,
                                const std::vector<const void*>& keep) {
    const bool graph = capturing(stream);
    TORCH_CHECK_VALUE(!strict || bytes <= bytes_, "num_nvl_bytes: this call needs ", bytes, " bytes of the receive pool, which holds ",
                      bytes_, "; create the Buffer with more num_nvl_bytes");
    if (!graph) settle_locked(stream);
    while (largest_free_locked() < bytes) {
        if (graph) {
            if (!strict) return;
            TORCH_CHECK(false, "num_nvl_bytes: the receive pool has no room for this call while a CUDA graph is captured (", bytes,
                        " bytes needed); free earlier outputs or capture with a larger num_nvl_bytes");
        }
        if (!evict_oldest_locked(stream, lock, keep) && !evict_oldest_locked(stream, lock)) {
            if (!strict) return;
            TORCH_CHECK_VALUE(false, "num_nvl_bytes: outputs of captured CUDA graphs hold the receive pool (", bytes, " bytes needed of ",
                              bytes_, "); create the Buffer with more num_nvl_bytes");
        }
        settle_locked(stream);
    }
}

void RecvPool::reserve(int64_t total_bytes, cudaStream_t stream, const std::vector<const void*>& keep) {
    std::unique_lock<std::mutex> lock(mutex_);
    make_room_locked(total_bytes, stream, lock, true, keep);
}

at::Tensor RecvPool::own_locked(int64_t offset, int64_t bytes, at::IntArrayRef sizes, at::ScalarType dtype, bool graph) {
    std::weak_ptr<RecvPool> pool = weak_from_this();
    at::Tensor t = at::from_blob(
        base_ + offset, sizes,
        [pool, offset](void*) {
            if (auto p = pool.lock()) p->released(offset);
        },
        at::TensorOptions().dtype(dtype).device(at::kCUDA, device_));
    live_.push_back(Region{offset, bytes, !graph, t.storage().getWeakStorageImpl()});
    return t;
}

std::pair<int64_t, int64_t> RecvPool::take_block(int64_t wanted, bool required, cudaStream_t stream) {
    std::unique_lock<std::mutex> lock(mutex_);
    TORCH_CHECK(block_offset_ < 0, "receive pool: a block is already taken");
    make_room_locked(required ? wanted : std::min(aligned(wanted), bytes_), stream, lock, required);
    const auto largest = largest_free_block_locked();
    if (largest == free_.end()) return {block_offset_ = 0, block_bytes_ = 0};  // nothing free: every receiver test fails
    block_offset_ = largest->first;
    block_bytes_ = largest->second;
    free_.erase(largest);
    // Under capture the fill would replay with the graph: only the part the call asked for, which the graph keeps.
    const int64_t fill = capturing(stream) ? std::min(aligned(wanted), block_bytes_) : block_bytes_;
    if (poison_) EP_CUDA_CHECK(cudaMemsetAsync(base_ + block_offset_, 0xff, fill, stream));
    return {block_offset_, block_bytes_};
}

at::Tensor RecvPool::tensor_at(int64_t offset, at::IntArrayRef sizes, at::ScalarType dtype, cudaStream_t stream) {
    int64_t numel = 1;
    for (int64_t s : sizes) numel *= s;
    if (numel == 0) return at::empty(sizes, at::TensorOptions().dtype(dtype).device(at::kCUDA, device_));
    const int64_t bytes = aligned(numel * static_cast<int64_t>(c10::elementSize(dtype)));
    std::unique_lock<std::mutex> lock(mutex_);
    TORCH_CHECK(block_offset_ >= 0 && offset >= block_offset_ && offset + bytes <= block_offset_ + block_bytes_,
                "receive pool: tensor at ", offset, " (", bytes, " bytes) outside the taken block");
    return own_locked(offset, bytes, sizes, dtype, capturing(stream));
}

void RecvPool::end_block(int64_t used) {
    std::unique_lock<std::mutex> lock(mutex_);
    TORCH_CHECK(block_offset_ >= 0 && used <= block_bytes_, "receive pool: end_block without a block, or past it");
    used = aligned(used);
    // Nothing wrote the rest (but the test-only poison fill, ordered on `stream`): it is free again at once, also for a
    // graph captured next (pending regions wait for a settle, which captures skip).
    if (used < block_bytes_) free_locked(block_offset_ + used, block_bytes_ - used);
    block_offset_ = -1;
    block_bytes_ = 0;
}

int64_t RecvPool::transient(int64_t bytes, cudaStream_t stream) {
    bytes = aligned(std::max<int64_t>(bytes, 1));
    std::unique_lock<std::mutex> lock(mutex_);
    const int64_t offset = allocate_locked(bytes);
    TORCH_CHECK(offset >= 0, "receive pool: no room for ", bytes, " bytes (reserve first)");
    live_.push_back(Region{offset, bytes, false, std::nullopt});
    if (poison_) EP_CUDA_CHECK(cudaMemsetAsync(base_ + offset, 0xff, bytes, stream));
    return offset;
}

void RecvPool::release(int64_t offset, cudaStream_t stream) {
    std::unique_lock<std::mutex> lock(mutex_);
    for (auto it = live_.begin(); it != live_.end(); ++it) {
        if (it->offset != offset) continue;
        pending_.push_back(Freed{offset, it->bytes, stream});
        live_.erase(it);
        return;
    }
}

void RecvPool::release_transient(int64_t offset, cudaStream_t stream) {
    // A region used while a graph was captured is written by every replay: it stays the graph's.
    if (!capturing(stream)) release(offset, stream);
}

void RecvPool::released(int64_t offset) {
    release(offset, c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device_)).stream());
}

void RecvPool::evict_all(cudaStream_t stream) {
    std::unique_lock<std::mutex> lock(mutex_);
    for (Region& r : live_) r.evictable = r.storage && r.storage->lock();  // graph outputs too: the memory goes away
    while (evict_oldest_locked(stream, lock)) {
    }
}

}  // namespace ep
