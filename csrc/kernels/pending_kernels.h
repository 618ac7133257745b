// The switch for kernels that are written, compiled and checked on the CPU, but have not yet run on a GPU (a session
// with no GPU lent wrote them). They replace their predecessors only with EP_DISPATCHER_PENDING_KERNELS=1, so what
// users run by default is always GPU-verified. tests/gpu/run_device.sh's `pending` phase runs the GPU suites with the
// switch on; once they pass and the speed is measured, the predecessor and this switch go. docs/architecture.md lists
// which kernels are pending.
#pragma once

#include <cstdlib>
#include <string>

namespace ep {

inline bool pending_kernels_enabled() {
    static const bool enabled = [] {
        const char* value = std::getenv("EP_DISPATCHER_PENDING_KERNELS");
        return value != nullptr && std::string(value) == "1";
    }();
    return enabled;
}

}  // namespace ep
