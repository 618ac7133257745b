// Wait stages of every engine: what a timed wait (sync.cuh's timed_wait) waits for, printed by its timeout report
// through stage_name(). A plain header: the host-only binding files include it too (the intranode and internode
// launchers pass a stage per barrier).
#pragma once

namespace ep::sync {

// One enum for every timed wait of the three engines. The ranges tell the engines apart (stage_engine()).
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
    // Low latency (epoch-tagged signals of low_latency.cu).
    kStageLowLatencyDispatchSend = 32,
    kStageLowLatencyDispatchRecv = 33,
    kStageLowLatencyCombineSend = 34,
    kStageLowLatencyCombineRecv = 35,
};

enum class Engine : int { kIntranode, kInternode, kLowLatency };

constexpr Engine stage_engine(int stage) {
    return stage >= kStageLowLatencyDispatchSend ? Engine::kLowLatency
           : stage >= kStageInternodeNotify      ? Engine::kInternode
                                                 : Engine::kIntranode;
}

}  // namespace ep::sync
