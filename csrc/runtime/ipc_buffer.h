// One rank's CUDA-IPC buffer for the intranode kernels, and the mapping of every peer's buffer.
//
// Layout of each buffer: a signal area (intranode.cuh: barrier flags, counts, published offsets) followed by the data
// area, the receive pool whose regions the dispatch outputs own and dispatch/combine write rows into. The barrier epoch lives in a
// separate, private device word so that kernels (and CUDA-graph replays) advance it without the host.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "../kernels/intranode.cuh"
#include "recv_pool.h"

namespace ep {

class IpcBuffer {
   public:
    IpcBuffer(int rank, int num_ranks, int64_t num_data_bytes, int device);
    ~IpcBuffer();
    IpcBuffer(const IpcBuffer&) = delete;
    IpcBuffer& operator=(const IpcBuffer&) = delete;

    // cudaIpcMemHandle_t of this rank's buffer, as bytes to exchange through the process group.
    std::string ipc_handle() const;
    // Maps every peer's buffer (handles[r] from rank r; this rank's own entry is ignored). Called once.
    void open_peers(const std::vector<std::string>& handles);
    void destroy();

    bool is_open() const { return opened_; }
    int rank() const { return rank_; }
    int num_ranks() const { return num_ranks_; }
    int device() const { return device_; }
    int64_t data_bytes() const { return data_bytes_; }
    char* local_data() const { return base_ + intranode::kSignalBytes; }
    // The data area as a pool of regions the returned tensors own (recv_pool.h).
    RecvPool& pool() const { return *pool_; }
    int* epoch() const { return epoch_; }
    // Host-mapped report of the count exchange (see intranode::CountReport), and the tag of the next report.
    intranode::CountReport* report() const { return report_; }
    intranode::CountReport* report_on_device() const { return report_device_; }
    int next_report_tag() { return ++report_tag_; }
    // Tag of a fresh dispatch whose report nobody waited for (num_worst_tokens): checked at the next call, 0 if none.
    int unchecked_report_tag = 0;
    // Fresh dispatches whose rows did not fit where notify laid them out, so that their data phase ran again (tests).
    int64_t dispatch_reruns = 0;
    const intranode::Peers& peers() const { return peers_; }

   private:
    int rank_, num_ranks_, device_;
    int64_t data_bytes_;
    char* base_ = nullptr;
    int* epoch_ = nullptr;
    intranode::CountReport* report_ = nullptr;
    std::shared_ptr<RecvPool> pool_;
    intranode::CountReport* report_device_ = nullptr;
    int report_tag_ = 0;
    intranode::Peers peers_{};
    std::vector<bool> mapped_;  // peers whose pointer came from cudaIpcOpenMemHandle (closed on destroy)
    bool opened_ = false, destroyed_ = false;
};

}  // namespace ep
