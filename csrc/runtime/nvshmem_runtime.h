// NVSHMEM host runtime: the parts of NVSHMEM the Python layer calls directly (bootstrap, symmetric memory,
// barriers). Compiled with the real library when setup.py finds NVSHMEM (-DEP_DISPATCHER_WITH_NVSHMEM), otherwise
// as stubs that raise a clear error, so that the extension always exposes the same functions.
#pragma once

#include <cstdint>
#include <string>

namespace ep::nvshmem_runtime {

// Whether this build links NVSHMEM.
bool built_with_nvshmem();

// A fresh NVSHMEM unique id (nvshmemx_get_uniqueid) as raw bytes, to be broadcast from rank 0 through the
// process group before every rank initialises NVSHMEM with it. Throws std::runtime_error without NVSHMEM.
std::string get_unique_id();

// Collective over `num_ranks` processes: initialise NVSHMEM on the current CUDA device from rank 0's unique id.
// Returns this process's PE (== rank). NVSHMEM is initialised once per process; a second call with the same
// world is a no-op, with another world it throws (call finalize() first).
int init(const std::string& unique_id, int rank, int num_ranks);
bool is_initialized();
void finalize();

// Collective: `num_bytes` of zeroed symmetric memory (the same offset on every PE); free() is collective too.
void* alloc(int64_t num_bytes);
void free(void* ptr);

// Collective: a buffer's teardown. Waits for the current device's work (kernels may still use the memory), frees the
// symmetric memory at `base` and nulls it. Returns false, doing nothing, when `base` is already null (destroyed).
bool sync_and_free(uint8_t*& base);

// Collective host barrier over all PEs (also completes outstanding NVSHMEM operations).
void barrier_all();

// The address of `ptr` (symmetric) on PE `pe` when this GPU can load/store it directly (NVLink/P2P), else 0.
int64_t peer_pointer(void* ptr, int pe);

}  // namespace ep::nvshmem_runtime
