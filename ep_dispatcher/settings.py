"""Every environment variable ep_dispatcher reads, in one place, with its meaning and default.

Each is read when it is needed, not at import: launchers and tests set some of them in a spawned rank after the
package is imported (e.g. ``EP_DISPATCHER_RANKS_PER_NODE`` to lay ranks out as virtual nodes). Build-time switches
(``EP_DISPATCHER_NO_CUDA``, ``EP_DISPATCHER_CUDA_ARCHS``, ``NVSHMEM_DIR``, ``MAX_JOBS``) are read by ``setup.py``.

- ``EP_DISPATCHER_TIMEOUT_S`` (100): seconds a kernel waits for a peer before it fails, naming rank and stage.
- ``EP_DISPATCHER_RANKS_PER_NODE`` (8): ranks of one NVLink domain when ``Buffer(num_ranks_per_node=None)``.
- ``EP_DISPATCHER_CONFIG_DIR`` (unset): a directory searched first for tuned configs (``<gpu>.json``).
- ``EP_DISPATCHER_INTERNODE_ENGINE`` (1): ``0`` makes a Buffer spanning nodes run the reference implementation.
- ``EP_DISPATCHER_LL_MAX_BLOCKS`` (SMs / ranks on the GPU): cap on the low-latency grids, whose blocks spin, so
  every rank's blocks must be resident together.
- ``EP_DISPATCHER_FUSED_EXPERT_MAJOR`` (1): the intranode CUDA engine serves ``dispatch(..., expert_major=True)``,
  its cached dispatch and its combine with the fused kernels (rows written straight into their expert-major slots,
  docs/fused_permute.md); ``0`` runs the fallback instead (engine dispatch + device permute, bit-identical). Read when
  a call is routed, so a spawned rank may set it after the import; every rank of a group must see the same value.
- ``EP_DISPATCHER_CHAINED_LAUNCH`` (1): a one-rank group launches its intranode and low-latency kernels chained
  (programmatic dependent launch: each kernel's launch overlaps the tail of the one before,
  ``csrc/kernels/launch.cuh``); ``0`` launches them one after another. Read by the extension, once per process.
- ``EP_DISPATCHER_PENDING_KERNELS`` (0): ``1`` runs the kernels that are written and CPU-checked but have not yet run
  on a GPU, in place of their predecessors (docs/architecture.md, "Pending kernels"); any other value, or none, runs
  GPU-verified kernels only. Read by the extension, once per process (``_C.pending_kernels_enabled()``).
- ``EP_DISPATCHER_MEGATRON_BACKEND``, ``EP_DISPATCHER_DEEPSPEED_BACKEND`` (auto): the plugins' ``Buffer(backend=)``.
- ``NVSHMEM_SYMMETRIC_SIZE`` (``num_rdma_bytes`` + 256 MiB): NVSHMEM's heap, sized once per process at its init.
- ``MASTER_ADDR`` (unset: loopback): the host rank 0 publishes for the DeepEP-compatible MPI stand-in
  (``compat.py``); torch.distributed reads it on its own too.
"""

from __future__ import annotations

import os
from typing import Optional

DEFAULT_TIMEOUT_S = 100.0  # a wait that takes this long is a bug (deadlock, dead peer), not a slow network
DEFAULT_RANKS_PER_NODE = 8


def timeout_s() -> float:
    return float(os.environ.get("EP_DISPATCHER_TIMEOUT_S", DEFAULT_TIMEOUT_S))


def ranks_per_node() -> int:
    return int(os.environ.get("EP_DISPATCHER_RANKS_PER_NODE", DEFAULT_RANKS_PER_NODE))


def config_dir() -> Optional[str]:
    return os.environ.get("EP_DISPATCHER_CONFIG_DIR") or None


def internode_engine_enabled() -> bool:
    return os.environ.get("EP_DISPATCHER_INTERNODE_ENGINE", "1") != "0"


def fused_expert_major() -> bool:
    return os.environ.get("EP_DISPATCHER_FUSED_EXPERT_MAJOR", "1") != "0"


def low_latency_max_blocks() -> Optional[int]:
    value = os.environ.get("EP_DISPATCHER_LL_MAX_BLOCKS")
    return None if value is None else max(1, int(value))


def pending_kernels() -> bool:
    """EP_DISPATCHER_PENDING_KERNELS as the extension reads it (exactly "1"); for reports, since the C++ decides."""
    return os.environ.get("EP_DISPATCHER_PENDING_KERNELS") == "1"


def plugin_backend(variable: str) -> str:
    """The backend a plugin's buffers use: env ``variable`` (``EP_DISPATCHER_<PLUGIN>_BACKEND``), else ``"auto"``."""
    return os.environ.get(variable, "auto")


def master_addr() -> Optional[str]:
    return os.environ.get("MASTER_ADDR") or None


def nvshmem_symmetric_size() -> Optional[int]:
    """NVSHMEM_SYMMETRIC_SIZE as bytes (NVSHMEM's k/m/g/t suffixes accepted), None when unset or unparsable."""
    text = os.environ.get("NVSHMEM_SYMMETRIC_SIZE", "").strip().lower()
    scale = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
    try:
        if text and text[-1] in scale:
            return int(float(text[:-1]) * scale[text[-1]])
        return int(text) if text else None
    except ValueError:
        return None


def default_nvshmem_symmetric_size(num_bytes: int) -> None:
    """NVSHMEM reads its heap size from the environment at initialisation: set it unless the user chose one."""
    os.environ.setdefault("NVSHMEM_SYMMETRIC_SIZE", str(num_bytes))
