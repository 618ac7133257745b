// Where a timed-out wait leaves its report for the host: one record in host-mapped pinned memory per process.
//
// The waiting kernel also prints the report, but a kernel that traps may lose its printf buffer with its context, so
// the host cannot count on seeing it. The record is plain host memory: the host reads it after the fault, and the
// error it raises names rank, peer and stage (timeout_report()). Each kernel file holds its own device pointer to the
// record (sync.cuh); install_timeout_record() points every one of them at the record, once per device.
#pragma once

#include <cuda_runtime.h>

#include <string>

namespace ep::sync {

struct TimeoutRecord {
    int ready;  // 1 once every field below is written (the last store, after a system fence)
    int stage, rank, peer, node, expert, half;  // the WaitSite (sync.cuh)
    long long timeout_ms;
    unsigned long long epoch, have;  // what the wait needed, and the value it last saw
};

// A kernel file's installer: points that file's device-side record pointer at `record` (on the current device).
using TimeoutRecordInstaller = cudaError_t (*)(TimeoutRecord* record);

// Called at static initialisation by every kernel file that includes sync.cuh. Returns true.
bool register_timeout_record_installer(TimeoutRecordInstaller installer);

// Allocates the record (once per process) and installs it in every kernel file for `device` (once per device).
// Buffers call it when they are created, before any of their kernels can wait.
void install_timeout_record(int device);

// The report of the first wait that timed out in this process, in the words of its engine, or "" if none did.
std::string timeout_report();

}  // namespace ep::sync
