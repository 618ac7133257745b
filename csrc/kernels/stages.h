// Wait stages of every engine: what a timed wait (sync.cuh's timed_wait) waits for, printed by its timeout report
// through stage_name(). A plain header: the host-only binding files include it too (the intranode and internode
// launchers pass a stage per barrier).
#pragma once

// stage_name() serves the device's timeout printf and the host's report of the record (runtime/timeout_record.h).
#ifdef __CUDACC__
#define EP_HOST_DEVICE __host__ __device__
#else
#define EP_HOST_DEVICE
#endif

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

EP_HOST_DEVICE constexpr Engine stage_engine(int stage) {
    return stage >= kStageLowLatencyDispatchSend ? Engine::kLowLatency
           : stage >= kStageInternodeNotify      ? Engine::kInternode
                                                 : Engine::kIntranode;
}

EP_HOST_DEVICE inline const char* stage_name(int stage) {
    switch (stage) {
        case kStageNotifyCounts: return "notify: waiting for peers' counts";
        case kStageDispatchData: return "dispatch: waiting for peers' token writes";
        case kStageCombineReady: return "combine: waiting for peers to be ready to receive";
        case kStageCombineData: return "combine: waiting for peers' expert outputs";
        case kStageDispatchReady: return "dispatch: waiting for peers' receive offsets";
        case kStageCombineDone: return "combine: waiting for peers to finish reading this rank's expert outputs";
        case kStageInternodeNotify: return "notify: waiting for the peer's counts";
        case kStageInternodeDispatchStart: return "cached dispatch: waiting for the peer to finish its previous call";
        case kStageInternodeDispatchSent: return "dispatch: waiting for the peer's RDMA puts";
        case kStageInternodeDispatchForwarded: return "dispatch: waiting for the peer's NVLink forwarding";
        case kStageInternodeCombineStart: return "combine: waiting for the peer to finish its previous call";
        case kStageInternodeCombineNvl: return "combine: waiting for the peer's expert outputs (NVLink leg)";
        case kStageInternodeCombineRdma: return "combine: waiting for the peer's node partials (RDMA leg)";
        case kStageLowLatencyDispatchSend: return "dispatch send: waiting for the peer to read this half's previous use";
        case kStageLowLatencyDispatchRecv: return "dispatch receive: waiting for the peer's token count";
        case kStageLowLatencyCombineSend: return "combine send: waiting for the peer to read this half's previous use";
        case kStageLowLatencyCombineRecv: return "combine receive: waiting for the expert's outputs";
        default: return "unknown stage";
    }
}

}  // namespace ep::sync
