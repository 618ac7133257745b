"""The low-latency state of one ``Buffer``: the two buffer halves, the hooks not yet run, the shape the buffer is laid
out for, the handles whose receive phase has not run; and the allocation of a low-latency dispatch's outputs.

The buffer is double-buffered: calls take the halves in turn, a call's hook (its receive phase) frees its half, and
at most ``NUM_LOW_LATENCY_BUFFERS`` calls are in flight, completing oldest first (docs/low_latency.md).
"""

from __future__ import annotations

from typing import Callable, List, Optional, Tuple

import torch

from .config import NUM_LOW_LATENCY_BUFFERS
from .handles import LowLatencyHandle
from .validation import is_capturing, low_latency_topk_error


class LowLatencyCalls:
    """Halves, pending hooks, shape and receipts of one buffer's low-latency calls.

    ``backend`` reports the ``topk_idx`` errors the kernels found (``take_low_latency_error``); ``clean(*shape)``
    cleans the buffer for a new shape (``Buffer.clean_low_latency_buffer``, collective).
    """

    def __init__(self, backend, clean: Callable[[int, int, int], None]):
        self._backend = backend
        self._clean = clean
        self.next_half = 0  # which half of the double-buffered low-latency area the next LL call uses
        self.half_pending = [False] * NUM_LOW_LATENCY_BUFFERS  # half -> an issued call's hook has not run
        self.shape: Optional[tuple] = None  # (max_tokens, hidden, num_experts) of the last low-latency call
        self.sized_shapes: set = set()  # shapes Buffer._check_low_latency has found the buffer large enough for
        self._unreceived: List[LowLatencyHandle] = []  # handles whose dispatch's receive phase (hook) has not run

    @property
    def num_pending(self) -> int:
        """Low-latency calls whose hook has not run yet (at most ``NUM_LOW_LATENCY_BUFFERS``)."""
        return sum(self.half_pending)

    def is_received(self, handle: LowLatencyHandle) -> bool:
        """Whether the receive phase of the dispatch that made ``handle`` has run (combine needs it)."""
        for pending in self._unreceived:  # at most NUM_LOW_LATENCY_BUFFERS; a loop builds no generator per call
            if pending is handle:
                return False
        return True

    def raise_reported_error(self, pending_hook: Optional[Callable[[], None]] = None) -> None:
        """Raise the ``ValueError`` for a bad ``topk_idx`` entry that a low-latency kernel has reported, if any.

        The record sits in host-mapped memory, so reading it costs no sync; it is read after each low-latency launch
        and in each hook. The call that raises has launched all its kernels, and ``pending_hook`` (its own receive
        phase) is run first, so the peers' kernels never wait for this rank: the ranks stay in step.
        """
        take = getattr(self._backend, "take_low_latency_error", None)
        found = take() if take is not None else None
        if found is None:
            return
        if pending_hook is not None:
            pending_hook()
        num_experts = self.shape[2] if self.shape is not None else 0
        raise low_latency_topk_error(*found, num_experts=num_experts)

    def enter_shape(self, shape: tuple) -> None:
        # The buffer is laid out per (max_tokens, hidden, num_experts), signals at shape-dependent offsets: a call of
        # another shape than the last first cleans it (collective: every rank makes the same calls), so bytes of the
        # old layout cannot pass for a signal. That erases what a pending hook is still to receive, and is a host
        # sync, which a CUDA graph cannot hold.
        if self.shape is None or shape == self.shape:
            self.shape = shape
            return
        if self.num_pending:
            raise RuntimeError(
                f"low-latency call: (num_max_dispatch_tokens_per_rank, hidden, num_experts) = {shape} differs from "
                f"the previous call's {self.shape} while {self.num_pending} hook(s) have not "
                "run; run the pending hooks before changing the shape"
            )
        if is_capturing():
            raise RuntimeError(
                f"low-latency call: (num_max_dispatch_tokens_per_rank, hidden, num_experts) changed from "
                f"{self.shape} to {shape} during CUDA-graph capture; the buffer must be cleaned (a host sync) "
                "first: make one eager call of the new shape before capturing"
            )
        self._clean(*shape)

    def take_half(self) -> int:
        # Halves are handed out in turn, so the half a new call gets is the one of the call two before it: if that
        # call's hook has not run, its unread data would be overwritten (also when a newer hook already ran).
        half = self.next_half
        if self.half_pending[half]:
            raise RuntimeError(
                f"low-latency call: buffer half {half} still holds an earlier call whose hook has not run "
                f"({self.num_pending} pending); only {NUM_LOW_LATENCY_BUFFERS} calls can "
                "be in flight (the buffer is double-buffered) and they complete oldest first: call the "
                "oldest pending hook first"
            )
        self.next_half = (half + 1) % NUM_LOW_LATENCY_BUFFERS
        return half

    def make_hook(
        self,
        receive: Callable[[], None],
        return_recv_hook: bool,
        half: int,
        handle: Optional[LowLatencyHandle] = None,
    ):
        """Run ``receive`` now (returns None), or with ``return_recv_hook`` return the hook that runs it once.
        ``handle`` (a dispatch's) counts as not received until ``receive`` has run."""
        if not return_recv_hook:
            receive()
            return None
        self.half_pending[half] = True
        if handle is not None:
            self._unreceived.append(handle)  # combine refuses a handle whose receive phase has not run
        called = False

        def hook() -> None:
            """Run the receive phase of the low-latency call that returned this hook (exactly once)."""
            nonlocal called
            if called:
                raise RuntimeError("hook: already called; each low-latency hook runs its receive phase exactly once")
            called = True
            self.half_pending[half] = False
            receive()
            if handle is not None:
                self._unreceived.remove(handle)
            self.raise_reported_error()

        return hook


def allocate_dispatch_outputs(
    num_local_experts: int, num_slots: int, hidden: int, use_fp8: bool, use_ue8m0: bool, device: torch.device
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``(recv_data [E_local, num_slots, hidden] float8_e4m3fn or bfloat16, recv_scales or None)`` of a low-latency
    dispatch; scales are ``[E_local, num_slots, groups]`` (float32, or int32 packed UE8M0) stored token-minor (a
    transposed view of ``[E_local, groups, num_slots]``, as grouped GEMMs want)."""
    if use_fp8:
        recv_data = torch.empty((num_local_experts, num_slots, hidden), dtype=torch.float8_e4m3fn, device=device)
        groups = hidden // 512 if use_ue8m0 else hidden // 128
        scale_dtype = torch.int32 if use_ue8m0 else torch.float32
        recv_scales = torch.empty((num_local_experts, groups, num_slots), dtype=scale_dtype, device=device).transpose(
            1, 2
        )
        if groups == 1:
            # Same memory, but a unit last stride: torch calls such a view contiguous, so .contiguous() keeps it,
            # and callers that view it as bytes (DeepEP's test does for UE8M0) need stride(-1) == 1.
            recv_scales = recv_scales.as_strided((num_local_experts, num_slots, 1), (num_slots, 1, 1))
    else:
        recv_data = torch.empty((num_local_experts, num_slots, hidden), dtype=torch.bfloat16, device=device)
        recv_scales = None
    return recv_data, recv_scales
