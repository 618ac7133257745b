#include "runtime/nvshmem_runtime.h"

#include <stdexcept>

#include "kernels/common.cuh"

#ifdef EP_DISPATCHER_WITH_NVSHMEM
// Host-only header: this step uses no NVSHMEM device code, so no -rdc and no device library.
#include <nvshmem_host.h>
#endif

namespace ep::nvshmem_runtime {

#ifdef EP_DISPATCHER_WITH_NVSHMEM

bool built_with_nvshmem() { return true; }

std::string get_unique_id() {
    // The initializer stamps the struct's version/size field, which NVSHMEM checks.
    nvshmemx_uniqueid_t unique_id = NVSHMEMX_UNIQUEID_INITIALIZER;
    const int status = nvshmemx_get_uniqueid(&unique_id);
    EP_HOST_ASSERT(status == 0, "nvshmemx_get_uniqueid returned ", status);
    return std::string(reinterpret_cast<const char*>(&unique_id), sizeof(unique_id));
}

#else

namespace {
constexpr const char* kNoNvshmemMessage =
    "ep_dispatcher was built without NVSHMEM: install nvidia-nvshmem-cu13 or set NVSHMEM_DIR and rebuild";
}  // namespace

bool built_with_nvshmem() { return false; }

std::string get_unique_id() { throw std::runtime_error(kNoNvshmemMessage); }

#endif

}  // namespace ep::nvshmem_runtime
