#include "runtime/driver_api.h"

#include <cuda_runtime.h>

#include "kernels/common.cuh"

namespace ep::driver {

void* get_entry_point_address(const char* name, unsigned int cuda_version) {
    void* address = nullptr;
    cudaDriverEntryPointQueryResult query_result = cudaDriverEntryPointSuccess;
#if CUDART_VERSION >= 12050
    // The versioned query returns the ABI the caller was compiled against even when the driver is newer.
    const cudaError_t status = cudaGetDriverEntryPointByVersion(name, &address, cuda_version, cudaEnableDefault, &query_result);
#else
    // Before 12.5 only the driver's default ABI for the runtime's version can be asked for.
    (void)cuda_version;
    const cudaError_t status = cudaGetDriverEntryPoint(name, &address, cudaEnableDefault, &query_result);
#endif
    if (status != cudaSuccess) {
        // The failed call also set the runtime's last error; clear it so that a later launch check
        // (EP_CUDA_CHECK(cudaGetLastError())) does not report this unrelated failure.
        (void)cudaGetLastError();
        EP_HOST_ASSERT(false, "cannot query CUDA driver entry point ", name, " (ABI ", cuda_version, "): ", cudaGetErrorName(status), ": ",
                       cudaGetErrorString(status));
    }
    EP_HOST_ASSERT(query_result != cudaDriverEntryPointVersionNotSufficent, "CUDA driver entry point ", name, " (ABI ", cuda_version,
                   "): the installed driver is older than that version");
    EP_HOST_ASSERT(query_result == cudaDriverEntryPointSuccess && address != nullptr, "CUDA driver entry point ", name, " (ABI ",
                   cuda_version, ") not found in the driver");
    return address;
}

}  // namespace ep::driver
