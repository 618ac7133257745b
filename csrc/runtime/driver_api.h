// Run-time access to CUDA driver API functions.
//
// The extension does not link libcuda (it must import on machines without a GPU driver, e.g. CI), so driver
// functions (cuMem*, cuStreamWaitValue*, ...) are fetched from the driver that the CUDA runtime loaded, by
// name and ABI version. Typed signatures come from <cudaTypedefs.h> (PFN_<name>_v<version>), headers only.
// Example:
//   static const auto mem_create = ep::driver::get_entry_point<PFN_cuMemCreate_v10020>("cuMemCreate", 10020);
#pragma once

#include <cudaTypedefs.h>

namespace ep::driver {

// Returns the address of driver function `name` with the ABI of CUDA version `cuda_version`
// (1000 * major + 10 * minor, as in the PFN_..._v<version> typedefs). Throws ep::HostError naming the
// function and the reason (no driver, driver too old, symbol unknown). Callers cache the result.
void* get_entry_point_address(const char* name, unsigned int cuda_version);

template <typename FunctionPointer>
FunctionPointer get_entry_point(const char* name, unsigned int cuda_version) {
    return reinterpret_cast<FunctionPointer>(get_entry_point_address(name, cuda_version));
}

}  // namespace ep::driver
