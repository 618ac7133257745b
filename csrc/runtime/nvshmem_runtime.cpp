#include "runtime/nvshmem_runtime.h"

#include <cuda_runtime.h>

#include <cstring>
#include <stdexcept>

#include "kernels/common.cuh"

#ifdef EP_DISPATCHER_WITH_NVSHMEM
#include <nvshmem.h>
#include <nvshmemx.h>
#endif

namespace ep::nvshmem_runtime {

#ifdef EP_DISPATCHER_WITH_NVSHMEM

namespace {
int g_num_ranks = 0;  // world size NVSHMEM was initialised with; 0 = not initialised
int g_rank = -1;
}  // namespace

bool built_with_nvshmem() { return true; }

std::string get_unique_id() {
    // The initializer stamps the struct's version/size field, which NVSHMEM checks.
    nvshmemx_uniqueid_t unique_id = NVSHMEMX_UNIQUEID_INITIALIZER;
    const int status = nvshmemx_get_uniqueid(&unique_id);
    EP_HOST_ASSERT(status == 0, "nvshmemx_get_uniqueid returned ", status);
    return std::string(reinterpret_cast<const char*>(&unique_id), sizeof(unique_id));
}

int init(const std::string& unique_id, int rank, int num_ranks) {
    if (g_num_ranks != 0) {
        EP_HOST_ASSERT(g_num_ranks == num_ranks && g_rank == rank, "NVSHMEM is already initialised in this process as PE ", g_rank,
                       " of ", g_num_ranks, "; a Buffer on another group (rank ", rank, " of ", num_ranks,
                       ") needs every low-latency/internode Buffer of the old group destroyed first");
        return g_rank;
    }
    nvshmemx_uniqueid_t uid = NVSHMEMX_UNIQUEID_INITIALIZER;
    EP_HOST_ASSERT(unique_id.size() == sizeof(uid), "NVSHMEM unique id has ", unique_id.size(), " bytes, expected ", sizeof(uid));
    std::memcpy(&uid, unique_id.data(), sizeof(uid));
    nvshmemx_init_attr_t attr = NVSHMEMX_INIT_ATTR_INITIALIZER;
    EP_HOST_ASSERT(nvshmemx_set_attr_uniqueid_args(rank, num_ranks, &uid, &attr) == 0, "nvshmemx_set_attr_uniqueid_args failed");
    const int status = nvshmemx_init_attr(NVSHMEMX_INIT_WITH_UNIQUEID, &attr);
    EP_HOST_ASSERT(status == 0, "nvshmemx_init_attr returned ", status, " (rank ", rank, " of ", num_ranks,
                   "); see NVSHMEM's log (NVSHMEM_DEBUG=INFO) for the transport that failed");
    const int pe = nvshmem_my_pe();
    EP_HOST_ASSERT(pe == rank && nvshmem_n_pes() == num_ranks, "NVSHMEM made this process PE ", pe, " of ", nvshmem_n_pes(),
                   ", expected ", rank, " of ", num_ranks);
    g_num_ranks = num_ranks;
    g_rank = rank;
    return pe;
}

bool is_initialized() { return g_num_ranks != 0; }

void finalize() {
    if (g_num_ranks == 0) return;
    nvshmem_finalize();
    g_num_ranks = 0;
    g_rank = -1;
}

void* alloc(int64_t num_bytes) {
    EP_HOST_ASSERT(g_num_ranks != 0, "NVSHMEM is not initialised");
    void* ptr = nvshmem_malloc(static_cast<size_t>(num_bytes));
    EP_HOST_ASSERT(ptr != nullptr, "nvshmem_malloc(", num_bytes,
                   ") failed: raise NVSHMEM_SYMMETRIC_SIZE (ep_dispatcher sets it from num_rdma_bytes when unset)");
    EP_CUDA_CHECK(cudaMemset(ptr, 0, static_cast<size_t>(num_bytes)));
    EP_CUDA_CHECK(cudaDeviceSynchronize());
    nvshmem_barrier_all();  // every PE has zeroed its copy before anyone writes into it
    return ptr;
}

void free(void* ptr) {
    if (ptr == nullptr || g_num_ranks == 0) return;
    nvshmem_barrier_all();  // nobody still writes into this memory
    nvshmem_free(ptr);
}

void barrier_all() {
    EP_HOST_ASSERT(g_num_ranks != 0, "NVSHMEM is not initialised");
    nvshmem_barrier_all();
}

int64_t peer_pointer(void* ptr, int pe) { return reinterpret_cast<int64_t>(nvshmem_ptr(ptr, pe)); }

#else

namespace {
constexpr const char* kNoNvshmemMessage =
    "ep_dispatcher was built without NVSHMEM: install nvidia-nvshmem-cu13 or set NVSHMEM_DIR and rebuild";
}  // namespace

bool built_with_nvshmem() { return false; }
std::string get_unique_id() { throw std::runtime_error(kNoNvshmemMessage); }
int init(const std::string&, int, int) { throw std::runtime_error(kNoNvshmemMessage); }
bool is_initialized() { return false; }
void finalize() {}
void* alloc(int64_t) { throw std::runtime_error(kNoNvshmemMessage); }
void free(void*) {}
void barrier_all() { throw std::runtime_error(kNoNvshmemMessage); }
int64_t peer_pointer(void*, int) { throw std::runtime_error(kNoNvshmemMessage); }

#endif

bool sync_and_free(uint8_t*& base) {
    if (base == nullptr) return false;
    EP_CUDA_CHECK(cudaDeviceSynchronize());
    free(base);
    base = nullptr;
    return true;
}

}  // namespace ep::nvshmem_runtime
