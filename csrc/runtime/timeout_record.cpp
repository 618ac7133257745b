#include "timeout_record.h"

#include <cstring>
#include <mutex>
#include <set>
#include <sstream>
#include <vector>

#include "../kernels/common.cuh"
#include "../kernels/stages.h"

namespace ep::sync {
namespace {

std::vector<TimeoutRecordInstaller>& installers() {
    static std::vector<TimeoutRecordInstaller> list;  // filled during static initialisation, read afterwards
    return list;
}

std::mutex& record_mutex() {
    static std::mutex mutex;
    return mutex;
}

volatile TimeoutRecord* host_record = nullptr;

}  // namespace

bool register_timeout_record_installer(TimeoutRecordInstaller installer) {
    installers().push_back(installer);
    return true;
}

void install_timeout_record(int device) {
    static std::set<int> installed;
    const std::lock_guard<std::mutex> lock(record_mutex());
    if (installed.count(device) != 0) return;
    if (host_record == nullptr) {
        void* record = nullptr;
        // Portable: one record serves every device of the process.
        EP_CUDA_CHECK(cudaHostAlloc(&record, sizeof(TimeoutRecord), cudaHostAllocMapped | cudaHostAllocPortable));
        std::memset(record, 0, sizeof(TimeoutRecord));
        host_record = static_cast<volatile TimeoutRecord*>(record);
    }
    int previous = 0;
    EP_CUDA_CHECK(cudaGetDevice(&previous));
    EP_CUDA_CHECK(cudaSetDevice(device));
    TimeoutRecord* on_device = nullptr;
    EP_CUDA_CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&on_device), const_cast<TimeoutRecord*>(host_record), 0));
    for (const TimeoutRecordInstaller install : installers()) EP_CUDA_CHECK(install(on_device));
    EP_CUDA_CHECK(cudaSetDevice(previous));
    installed.insert(device);
}

std::string timeout_report() {
    if (host_record == nullptr || host_record->ready != 1) return "";
    const volatile TimeoutRecord& r = *host_record;
    std::ostringstream line;
    line << "ep_dispatcher: timeout after " << r.timeout_ms << " ms on rank " << r.rank;
    switch (stage_engine(r.stage)) {
        case Engine::kIntranode:
            line << " waiting for peer " << r.peer << ", stage '" << stage_name(r.stage) << "' (epoch " << r.epoch << ", have " << r.have
                 << ")";
            break;
        case Engine::kInternode:
            line << " (node " << r.node << ") waiting for rank " << r.peer << ", internode stage '" << stage_name(r.stage) << "' (epoch "
                 << r.epoch << ", have " << r.have << ")";
            break;
        case Engine::kLowLatency:
            line << " waiting for rank " << r.peer << ", expert " << r.expert << ", low-latency stage '" << stage_name(r.stage)
                 << "' (buffer half " << r.half << ", epoch " << (r.epoch & 0xffffffffull) << ", have " << (r.have >> 32) << ")";
            break;
    }
    return line.str();
}

}  // namespace ep::sync
