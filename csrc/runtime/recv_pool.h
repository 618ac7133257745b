// The receive pool: the data area of a rank's CUDA-IPC buffer, handed out as regions that peers write into
// directly, and returned to the caller as ordinary torch tensors that own their region.
//
// Why: a dispatch writes every received row once, straight into its final place. If that place were a staging
// area, the rows would need a copy-out pass (every byte across HBM twice). Here the final place is a region of the
// pool, and the tensor the caller gets is that region: its storage's deleter gives the region back. So there is no
// lifetime rule for callers: a tensor stays valid as long as it lives, like any other tensor.
//
// When a new call does not fit because earlier outputs are still alive, the oldest live regions are *evicted*: their
// bytes are copied (stream-ordered) into memory from torch's caching allocator and the tensors' storage is re-pointed
// there (every view follows, since views share the storage). So a call fits whenever it fits in the empty pool, a
// test every rank makes alike from the count matrix (no rank can fail alone and leave its peers waiting).
//
// Reuse is stream-ordered: a freed region is reused only after the current stream waits for the stream that was
// current when it was freed. Regions handed out while a CUDA graph is captured belong to the graph (its replays
// write them): they are never evicted, and transient ones are never reused.
#pragma once

#include <ATen/ATen.h>
#include <c10/core/StorageImpl.h>
#include <c10/util/intrusive_ptr.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <utility>
#include <vector>

namespace ep {

class RecvPool : public std::enable_shared_from_this<RecvPool> {
   public:
    static constexpr int64_t kAlignment = 128;  // every region starts on a 128-byte boundary (16-byte vectors, full lines)

    RecvPool(char* base, int64_t bytes, int device);
    ~RecvPool();

    // Bytes `sizes` take once aligned, so callers can test "fits in the empty pool" before allocating.
    static int64_t aligned(int64_t bytes) { return (bytes + kAlignment - 1) / kAlignment * kAlignment; }
    int64_t capacity() const { return bytes_; }

    // Makes room for `total_bytes` in one or more regions (evicting the oldest evictable outputs if needed) and makes
    // `stream` wait for the streams that freed the regions it may reuse. Call before the allocations of one call.
    // `keep`: data pointers of this call's inputs that lie in the pool (combine's x read in place): other outputs are
    // evicted first, these only if nothing else makes the room.
    void reserve(int64_t total_bytes, cudaStream_t stream, const std::vector<const void*>& keep = {});
    // A block for a call whose outputs the device lays out (fresh dispatch: their sizes come from the count exchange,
    // after the data kernel is launched): the largest free region, after evicting the oldest outputs until it holds
    // `wanted` bytes or nothing is left to evict (`required`: raise instead, as reserve does). Returns {offset, bytes}.
    // Its head becomes the call's tensors through tensor_at(); end_block() then gives back everything past `used`
    // bytes. One block at a time.
    std::pair<int64_t, int64_t> take_block(int64_t wanted, bool required, cudaStream_t stream);
    // A tensor on [offset, offset + its aligned bytes) of the taken block, owned by the tensor (its deleter gives the
    // region back).
    at::Tensor tensor_at(int64_t offset, at::IntArrayRef sizes, at::ScalarType dtype, cudaStream_t stream);
    void end_block(int64_t used);
    // A region for the length of one call (combine's returned rows); give it back with release_transient.
    int64_t transient(int64_t bytes, cudaStream_t stream);
    void release_transient(int64_t offset, cudaStream_t stream);
    // Offset of a tensor's region (its data pointer must lie in the pool).
    int64_t offset_of(const at::Tensor& t) const { return static_cast<char*>(t.data_ptr()) - base_; }
    // Whether a contiguous tensor's bytes lie in the pool (peers can then read it where it is).
    bool holds(const at::Tensor& t) const {
        const char* begin = static_cast<const char*>(t.data_ptr());
        return t.is_contiguous() && t.numel() > 0 && begin >= base_ && begin + t.nbytes() <= base_ + bytes_;
    }

    // Copies every live output out of the pool (the pool's memory is about to be freed).
    void evict_all(cudaStream_t stream);
    // Tests: fill each new region with 0xff so that rows a kernel fails to write show up.
    void set_poison(bool on) { poison_ = on; }

   private:
    struct Region {
        int64_t offset, bytes;
        bool evictable;
        std::optional<c10::weak_intrusive_ptr<c10::StorageImpl>> storage;  // none for transient regions
    };

    int64_t allocate_locked(int64_t bytes);
    at::Tensor own_locked(int64_t offset, int64_t bytes, at::IntArrayRef sizes, at::ScalarType dtype, bool graph);
    void make_room_locked(int64_t bytes, cudaStream_t stream, std::unique_lock<std::mutex>& lock, bool strict,
                          const std::vector<const void*>& keep = {});
    void free_locked(int64_t offset, int64_t bytes);
    void settle_locked(cudaStream_t stream);
    bool evict_oldest_locked(cudaStream_t stream, std::unique_lock<std::mutex>& lock, const std::vector<const void*>& keep = {});
    std::map<int64_t, int64_t>::const_iterator largest_free_block_locked() const;  // free_.end() if none
    int64_t largest_free_locked() const;
    void release(int64_t offset, cudaStream_t stream);  // queues the region for reuse once `stream` is past its last use
    void released(int64_t offset);                       // a tensor's deleter
    static bool capturing(cudaStream_t stream);

    char* base_;
    int64_t bytes_;
    int device_;
    bool poison_ = false;
    std::mutex mutex_;
    std::map<int64_t, int64_t> free_;                        // offset -> bytes, coalesced
    std::list<Region> live_;                                 // oldest first
    struct Freed {
        int64_t offset, bytes;
        cudaStream_t stream;  // current when it was freed: reuse waits for it
    };
    std::vector<Freed> pending_;
    int64_t block_offset_ = -1, block_bytes_ = 0;            // the taken block (take_block .. end_block)
    std::vector<cudaEvent_t> events_;                        // reused for the cross-stream waits of settle
};

}  // namespace ep
