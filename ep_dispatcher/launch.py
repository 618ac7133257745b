"""Start N local ranks (processes) with an initialised process group: used by the demo, tests and benchmarks."""

from __future__ import annotations

import os
import socket
import sys
import time
import traceback
from datetime import timedelta
from typing import Any, Callable, List, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

DEFAULT_GROUP_TIMEOUT_S = 300  # a collective stuck this long means a peer died; fail instead of hanging CI
FAILURE_GRACE_S = 15.0  # after one rank failed, how long the others get to finish or fail before they are killed


def use_nvshmem_on_one_machine() -> None:
    """NVSHMEM settings for ranks on one machine without an RDMA NIC, e.g. several ranks sharing one GPU (tests,
    benchmarks): P2P transport only, no NVLink multicast, bootstrap over loopback. Values already set win."""
    os.environ.setdefault("NVSHMEM_REMOTE_TRANSPORT", "none")
    os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")
    os.environ.setdefault("NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME", "lo")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, fn: Callable, world_size: int, port: int, backend: str, args: tuple, results, timeout_s: float):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)  # N ranks on a few cores: one thread each avoids oversubscription
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )
    try:
        value = fn(rank, world_size, *args)
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
        dist.destroy_process_group()
        raise
    dist.destroy_process_group()
    results.put((rank, "ok", value))  # SimpleQueue writes synchronously: the result is out before we exit
    sys.stdout.flush()
    sys.stderr.flush()
    # Exit without interpreter teardown: libraries' background threads (gloo, DeepSpeed) can abort the process
    # in their destructors ("terminate called without an active exception") after the work has succeeded.
    os._exit(0)


def spawn(
    fn: Callable, world_size: int, *args: Any, backend: str = "gloo", timeout_s: float = DEFAULT_GROUP_TIMEOUT_S
) -> List[Any]:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` processes; returns each rank's return value.

    ``fn`` must be importable (defined at module level). A failure on any rank raises ``RuntimeError`` with that
    rank's traceback.
    """
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    port = free_port()
    procs = [
        ctx.Process(target=_entry, args=(r, fn, world_size, port, backend, args, results, timeout_s), daemon=False)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    outcomes: dict = {}
    failure: Optional[str] = None
    deadline = time.monotonic() + timeout_s + 60
    failed_at: Optional[float] = None
    # Poll rather than join: once a rank has failed, its peers are usually stuck in a collective or a kernel wait
    # for it; give them FAILURE_GRACE_S to fail on their own, then kill them, so the traceback arrives promptly.
    while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
        while not results.empty():
            rank, status, value = results.get()
            outcomes[rank] = value
            if status == "error" and failure is None:
                failure = f"rank {rank} failed:\n{value}"
                failed_at = time.monotonic()
        if failed_at is not None and time.monotonic() - failed_at > FAILURE_GRACE_S:
            break
        time.sleep(0.05)
    while not results.empty():
        rank, status, value = results.get()
        outcomes[rank] = value
        if status == "error" and failure is None:
            failure = f"rank {rank} failed:\n{value}"
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
            failure = failure or f"a rank did not finish within {timeout_s + 60:.0f} s"
    if failure is None:
        bad = [r for r, p in enumerate(procs) if p.exitcode != 0]
        if bad or len(outcomes) != world_size:
            failure = f"ranks {bad} exited with codes {[procs[r].exitcode for r in bad]} and no traceback"
    if failure:
        raise RuntimeError(failure)
    return [outcomes[r] for r in range(world_size)]
