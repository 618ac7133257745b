"""Stream events for overlapping communication with compute.

``EventHandle`` is DeepEP's event object: constructing one records a CUDA event on the current stream, and
``current_stream_wait()`` makes the current stream wait for it. ``EventOverlap`` wraps the event recorded after an
asynchronous call (``async_finish=True``) and keeps the tensors that call still reads or writes alive until the
caller waits on it. On CPU (reference backend on gloo) every call is already complete when it returns, so events
are empty and waiting is a no-op.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence, Union

import torch


class EventHandle:
    """A CUDA event recorded on the current stream when constructed (DeepEP's ``deep_ep_cpp.EventHandle``).

    ``EventHandle()`` records now; ``EventHandle(event)`` wraps an already recorded ``torch.cuda.Event``. Without a
    CUDA device it holds nothing and every method returns at once (the work it would follow is already done).
    """

    def __init__(self, event: Optional["torch.cuda.Event"] = None):
        if event is None and torch.cuda.is_available():
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream())
        self.event = event

    def current_stream_wait(self) -> None:
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)

    def query(self) -> bool:
        return True if self.event is None else self.event.query()

    def synchronize(self) -> None:
        if self.event is not None:
            self.event.synchronize()


class EventOverlap:
    """A handle on work queued on the communication stream.

    ``event`` is an ``EventHandle`` (a ``torch.cuda.Event`` passed in is wrapped in one) or None.
    ``current_stream_wait()`` makes the current CUDA stream wait for it. Used as a context manager, the code inside
    the ``with`` block overlaps the communication and the current stream waits on exit. DeepEP asserts that an
    event exists in ``current_stream_wait()``; here an empty event (synchronous call, CPU) waits for nothing.
    """

    def __init__(
        self,
        event: Union[EventHandle, "torch.cuda.Event", None] = None,
        extra_tensors: Optional[Sequence[Any]] = None,
    ):
        if event is not None and not isinstance(event, EventHandle):
            event = EventHandle(event)
        self.event = event
        # Tensors the queued work still uses: holding them stops the caching allocator from reusing their
        # memory before the communication stream is done with it.
        self.extra_tensors = tuple(extra_tensors) if extra_tensors else ()

    @property
    def cuda_event(self) -> Optional["torch.cuda.Event"]:
        """The underlying ``torch.cuda.Event`` (None when there is none)."""
        return None if self.event is None else self.event.event

    def current_stream_wait(self) -> None:
        if self.event is not None:
            self.event.current_stream_wait()

    def __enter__(self) -> "EventOverlap":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.current_stream_wait()

    def __repr__(self) -> str:
        return f"EventOverlap(event={'none' if self.cuda_event is None else 'cuda'})"
