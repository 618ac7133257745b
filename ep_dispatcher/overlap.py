"""Stream events for overlapping communication with compute.

``EventOverlap`` wraps the CUDA event recorded after an asynchronous call (``async_finish=True``) and keeps
the tensors that call still reads or writes alive until the caller waits on it. On CPU (reference backend on
gloo) every call is already complete when it returns, so the event is empty and waiting is a no-op.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch


class EventOverlap:
    """A handle on work queued on the communication stream.

    ``current_stream_wait()`` makes the current CUDA stream wait for it. Used as a context manager,
    the code inside the ``with`` block overlaps the communication and the current stream waits on exit.
    """

    def __init__(self, event: Optional["torch.cuda.Event"] = None, extra_tensors: Optional[Sequence[Any]] = None):
        self.event = event
        # Tensors the queued work still uses: holding them stops the caching allocator from reusing their
        # memory before the communication stream is done with it.
        self.extra_tensors = tuple(extra_tensors) if extra_tensors else ()

    def current_stream_wait(self) -> None:
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)

    def __enter__(self) -> "EventOverlap":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.current_stream_wait()

    def __repr__(self) -> str:
        return f"EventOverlap(event={'none' if self.event is None else 'cuda'})"
