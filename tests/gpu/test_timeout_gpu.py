"""A rank that never arrives makes its peers' kernels give up with rank, peer and stage, instead of hanging.

The waiting kernel traps after printing, which poisons its CUDA context (and, under MPS, may affect every client
of the server): run this file last, in its own MPS session (tests/gpu/run_device.sh does).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import pytest

from tests.gpu.common import require_gpu

pytestmark = pytest.mark.gpu
require_gpu()

_SCRIPT = textwrap.dedent(
    """
    import sys, time, torch, torch.distributed as dist
    from ep_dispatcher import Buffer
    from ep_dispatcher.launch import spawn

    def work(rank, world):
        torch.cuda.set_device(0)
        buf = Buffer(None, num_nvl_bytes=64 << 20, backend="cuda", timeout_s=2.0)
        topk_idx = torch.zeros((8, 1), dtype=torch.int64, device="cuda")
        per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(topk_idx, 2)
        x = torch.randn((8, 128), device="cuda").to(torch.bfloat16)
        if rank == 1:
            # Never joins the dispatch, but stays alive past rank 0's 2 s timeout: if its process ended, its buffer
            # (which rank 0's barrier writes into) would go with it, and rank 0 could fault before its timeout prints.
            time.sleep(8)
            return "absent"
        try:
            buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank)
            torch.cuda.synchronize()
        except RuntimeError as e:
            return "error: " + str(e).splitlines()[0]
        return "no error"

    if __name__ == "__main__":
        try:
            print(spawn(work, 2, timeout_s=60))
        except RuntimeError as e:
            print("spawn failed:", e)
        sys.stdout.flush()
    """
)


def _run_case(tmp_path, name: str, source: str, timeout_s: int) -> str:
    """Run a timeout case in its own process (its CUDA context ends up poisoned); returns stdout + stderr."""
    script = tmp_path / name
    script.write_text(source)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=timeout_s, env=env)
    return proc.stdout + proc.stderr


def test_missing_peer_times_out_with_rank_peer_and_stage(tmp_path):
    out = _run_case(tmp_path, "timeout_case.py", _SCRIPT, 120)
    # Rank 0's exception itself names peer and stage (from the host-mapped timeout record, which survives the trap;
    # the kernel's printf may or may not reach the pipe).
    error = next((line for line in out.splitlines() if "error: " in line), out[-4000:])
    assert "ep_dispatcher: timeout after 2000 ms on rank 0 waiting for peer 1" in error, out[-4000:]
    assert "notify: waiting for peers' counts" in error, out[-4000:]


_INTERNODE_SCRIPT = textwrap.dedent(
    """
    import os, sys, torch
    from ep_dispatcher import Buffer, Config
    from ep_dispatcher.launch import spawn, use_nvshmem_on_one_machine

    def work(rank, world):
        os.environ["EP_DISPATCHER_RANKS_PER_NODE"] = "2"
        use_nvshmem_on_one_machine()
        torch.cuda.set_device(0)
        rdma = Config().get_rdma_buffer_size_hint(256, world, 2, num_max_tokens_per_rank=8)
        buf = Buffer(None, num_nvl_bytes=64 << 20, num_rdma_bytes=rdma, backend="cuda", timeout_s=2.0)
        assert "dispatch" in buf.engine_calls
        topk_idx = torch.zeros((8, 1), dtype=torch.int64, device="cuda")
        per_rank, per_node, _, in_rank, _ = buf.get_dispatch_layout(topk_idx, world)
        x = torch.randn((8, 128), device="cuda").to(torch.bfloat16)
        if rank == world - 1:
            return "absent"  # never joins the dispatch
        try:
            buf.dispatch(x, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_node, is_token_in_rank=in_rank)
            torch.cuda.synchronize()
        except RuntimeError as e:
            return "error: " + str(e).splitlines()[0]
        return "no error"

    if __name__ == "__main__":
        try:
            print(spawn(work, 4, timeout_s=90))
        except RuntimeError as e:
            print("spawn failed:", e)
        sys.stdout.flush()
    """
)


def test_internode_missing_peer_times_out_with_rank_peer_and_stage(tmp_path):
    out = _run_case(tmp_path, "internode_timeout_case.py", _INTERNODE_SCRIPT, 150)
    # A waiting rank's error (rank 3 never sends its counts) names rank, node, peer and stage: its count read appends
    # the timeout record. Which of ranks 0-2 times out first varies: under MPS the first trap can take the other
    # waiting ranks' contexts down before their own timeouts fire, so as few as one waiting rank's report may appear.
    line = r"ep_dispatcher: timeout after 2000 ms on rank [012] \(node [01]\) waiting for rank 3"
    assert re.search(line, out), out[-4000:]
    assert "internode stage 'notify: waiting for the peer's counts'" in out, out[-4000:]
