// Wait stages of the high-throughput engines, named in timeout reports (sync.cuh) and passed by the host launchers.
// A plain header: the host-only binding files include it too.
#pragma once

namespace ep::sync {

// One enum for every timed wait of the intranode and internode engines; sync.cuh's stage_name() prints them.
enum Stage : int {
    // Intranode (CUDA-IPC barrier of sync.cuh).
    kStageNotifyCounts = 0,
    kStageDispatchData = 2,
    kStageCombineReady = 3,
    kStageCombineData = 4,
    kStageDispatchReady = 5,
    kStageCombineDone = 6,
    // Internode (NVSHMEM signals of internode.cu).
    kStageInternodeNotify = 16,
    kStageInternodeDispatchStart = 17,
    kStageInternodeDispatchSent = 18,
    kStageInternodeDispatchForwarded = 19,
    kStageInternodeCombineStart = 20,
    kStageInternodeCombineNvl = 21,
    kStageInternodeCombineRdma = 22,
};

}  // namespace ep::sync
