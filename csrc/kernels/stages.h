// Barrier stages of the intranode engine, named in timeout reports (sync.cuh) and passed by the host launchers.
// A plain header: the host-only binding files include it too.
#pragma once

namespace ep::sync {

enum Stage : int {
    kStageNotifyCounts = 0,
    kStageNotifyDone = 1,
    kStageDispatchData = 2,
    kStageCombineReady = 3,
    kStageCombineData = 4,
    kStageDispatchReady = 5,
    kStageCombineDone = 6,
};

}  // namespace ep::sync
