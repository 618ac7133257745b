// NVSHMEM host runtime: the parts of NVSHMEM the Python layer calls directly. Compiled with the real library
// when setup.py finds NVSHMEM (-DEP_DISPATCHER_WITH_NVSHMEM), otherwise as stubs that raise a clear error,
// so that the extension always exposes the same functions.
#pragma once

#include <string>

namespace ep::nvshmem_runtime {

// Whether this build links NVSHMEM.
bool built_with_nvshmem();

// A fresh NVSHMEM unique id (nvshmemx_get_uniqueid) as raw bytes, to be broadcast from rank 0 through the
// process group before every rank initialises NVSHMEM with it. Throws std::runtime_error without NVSHMEM.
std::string get_unique_id();

}  // namespace ep::nvshmem_runtime
