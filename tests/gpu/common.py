"""What the GPU test modules share: the module-level skips, the world sizes, a rank's device, where results differ.

Call ``require_extension()`` (or ``require_extension(nvshmem=True)``) at the top of a module, before importing what
needs the extension: it skips the whole module when there is no GPU, no built ``ep_dispatcher._C`` or (with
``nvshmem``) no NVSHMEM in that build, and returns ``_C`` otherwise. ``require_gpu()`` skips only without a GPU.
"""

from __future__ import annotations

import os

import pytest
import torch

# World sizes of the multi-rank tests; EP_GPU_TEST_WORLDS="2,4" picks a subset.
WORLDS = [int(w) for w in os.environ.get("EP_GPU_TEST_WORLDS", "2,4,8").split(",")]
# The same plus one rank: loopback, whose kernels alone are launched chained (csrc/kernels/launch.cuh).
WORLDS_AND_ONE = sorted({1, *WORLDS})
NUM_SMS = 8  # per rank: 8 ranks x 8 SMs fit on one H200 even without the MPS thread limit


def require_gpu() -> None:
    """A module-level skip when there is no CUDA device (for modules that do not need the extension itself)."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device", allow_module_level=True)


def require_extension(nvshmem: bool = False):
    """``ep_dispatcher._C``, or a module-level skip saying why it cannot run here."""
    require_gpu()
    try:
        import ep_dispatcher._C as _C
    except ImportError as e:  # pragma: no cover - depends on the build
        pytest.skip(f"ep_dispatcher._C is not built: {e}", allow_module_level=True)
    if nvshmem and not _C.has_nvshmem():
        pytest.skip("ep_dispatcher._C was built without NVSHMEM", allow_module_level=True)
    return _C


def set_device(rank: int) -> torch.device:
    """Rank ``rank``'s GPU: ranks share the visible GPUs round-robin (all on one GPU when only one is visible)."""
    torch.cuda.set_device(rank % torch.cuda.device_count())
    return torch.device("cuda", torch.cuda.current_device())


def where_differs(a: torch.Tensor, b: torch.Tensor) -> str:
    """Where two same-shaped tensors differ: how many rows, the first rows, and the first differing row's values."""
    if a.dim() == 0:
        return f"{a.item()} vs {b.item()}"
    bad = (a != b).reshape(a.size(0), -1).any(1)  # NaN != NaN counts as a difference too
    rows = bad.nonzero().flatten()
    first = int(rows[0]) if rows.numel() else 0
    return (
        f"shape {tuple(a.shape)}, {rows.numel()} rows differ, first {rows[:6].tolist()}; "
        f"row {first}: {a[first].flatten()[:6].tolist()} vs {b[first].flatten()[:6].tolist()}"
    )
