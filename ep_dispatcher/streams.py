"""Stream plumbing of the high-throughput calls: ``previous_event`` / ``async_finish`` / ``allocate_on_comm_stream``.

A call with neither ``previous_event`` nor ``async_finish`` runs on the current stream; otherwise on the buffer's
communication stream (high priority), ordered after ``previous_event`` (or the current stream), with the
``record_stream`` calls that keep its inputs and outputs alive for the stream that uses them.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

from .handles import DispatchHandle, LowLatencyHandle
from .overlap import EventOverlap


def check_event(previous_event, async_finish: bool, allocate_on_comm_stream: bool) -> None:
    """Validate a call's stream arguments (``TypeError``/``ValueError`` naming the argument)."""
    if previous_event is not None and not isinstance(previous_event, EventOverlap):
        raise TypeError(f"previous_event: expected an EventOverlap or None, got {type(previous_event).__name__}")
    if allocate_on_comm_stream and (previous_event is None or not async_finish):
        raise ValueError(
            "allocate_on_comm_stream: needs previous_event and async_finish=True (the outputs then "
            "belong to the communication stream until the returned event is waited on)"
        )


class CommStream:
    """One buffer's communication stream (created on first use) and the way a call runs on it."""

    def __init__(self) -> None:
        self.stream: Optional[torch.cuda.Stream] = None

    def get(self, device) -> torch.cuda.Stream:
        """The stream, created on ``device`` the first time (high priority: comm gates compute)."""
        if self.stream is None:
            self.stream = torch.cuda.Stream(device=device, priority=-1)
        return self.stream

    def run(
        self,
        device: torch.device,
        previous_event: Optional[EventOverlap],
        async_finish: bool,
        allocate_on_comm_stream: bool,
        inputs: Sequence,
        call: Callable,
    ):
        """Run ``call`` on the communication stream after ``previous_event`` (or the current stream); a call with
        neither ``previous_event`` nor ``async_finish`` runs on the current stream itself (same order, less work).

        Returns ``(result, EventOverlap)``. On CPU the call is synchronous and the event empty.
        """
        if device.type != "cuda":
            return call(), EventOverlap()
        if previous_event is None and not async_finish:
            # The caller waits for the result anyway: on the current stream the call is ordered exactly as it would
            # be through the communication stream, without the stream switch and the two cross-stream waits.
            return call(), EventOverlap()
        compute = torch.cuda.current_stream(device)
        comm = self.get(device)
        if previous_event is not None and previous_event.cuda_event is not None:
            comm.wait_event(previous_event.cuda_event)
        else:
            comm.wait_stream(compute)
        with torch.cuda.stream(comm):
            result = call()
        outputs = [t for t in _flatten(result) if isinstance(t, torch.Tensor)]
        if not allocate_on_comm_stream:
            for t in outputs:
                t.record_stream(compute)  # outputs are used (and freed) on the compute stream
        if async_finish:
            for t in _flatten(inputs):
                if isinstance(t, torch.Tensor) and t.is_cuda:
                    t.record_stream(comm)  # inputs stay allocated until the comm stream is done reading them
            event = torch.cuda.Event()
            event.record(comm)
            return result, EventOverlap(event, [t for t in _flatten(inputs) if isinstance(t, torch.Tensor)] + outputs)
        compute.wait_stream(comm)
        return result, EventOverlap()


def _flatten(obj):
    if isinstance(obj, (DispatchHandle, LowLatencyHandle)):
        return  # handles are tuples too; their tensors are the backend's, not this call's outputs
    if isinstance(obj, (tuple, list)):
        for item in obj:
            yield from _flatten(item)
    else:
        yield obj
