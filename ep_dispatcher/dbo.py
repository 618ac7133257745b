"""Dual-batch overlap (DBO): run two (or more) micro-batches through one stage list, so that one micro-batch's
low-latency communication is in flight while another micro-batch computes.

A model step is written once, as a flat list of stages::

    stages = [attention, Send("dispatch", dispatch_send), YIELD,
              Recv("dispatch"), experts, Send("combine", combine_send), YIELD,
              Recv("combine"), residual]
    MicroBatchOverlap(stages, num_micro_batches=2).run([state_0, state_1])

* a plain callable ``fn(state) -> None`` is compute;
* ``Send(name, fn)``: ``fn(state)`` issues a low-latency call with ``return_recv_hook=True`` (only the send phase)
  and returns its hook;
* ``Recv(name)`` runs the micro-batch's pending hook of that send (the receive phase);
* ``YIELD`` ends a segment: the scheduler switches to the next micro-batch there.

The scheduler runs the segments round-robin (micro-batch 0's segment 0, micro-batch 1's segment 0, micro-batch 0's
segment 1, ...; ``stagger`` delays each micro-batch's start by that many segments), so with a ``YIELD`` right after
each ``Send`` every transfer overlaps the other micro-batch's compute. With ``num_micro_batches=1`` the same list is
the plain path: each hook runs at its ``Recv``, nothing overlaps.

The order of execution is fixed when the scheduler is built (no data-dependent choice, no host sync), so
``run`` can be called inside ``torch.cuda.graph`` capture when the stages themselves are capturable. Every misuse
the order reveals (a hook run twice or out of order, a third low-latency call in flight, a send never received) is
reported when the scheduler is built, before any rank communicates: an error raised mid-step on one rank would
leave its peers waiting in a collective.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from .config import NUM_LOW_LATENCY_BUFFERS

__all__ = ["YIELD", "DBOScheduleError", "MicroBatchOverlap", "Recv", "Send"]

RecvHook = Callable[[], None]


class DBOScheduleError(RuntimeError):
    """A stage list that would run a receive hook twice or out of order, put more low-latency calls in flight than
    the Buffer has buffer halves, or leave a send without its receive."""


class _Yield:
    """The type of ``YIELD`` (compare with ``entry is YIELD``)."""

    def __repr__(self) -> str:
        return "YIELD"


YIELD = _Yield()
"""Marks a switch point between micro-batches in a stage list."""


@dataclass(frozen=True)
class Send:
    """Send phase of one low-latency call.

    ``fn(state)`` calls ``Buffer.low_latency_dispatch`` or ``low_latency_combine`` once, with
    ``return_recv_hook=True``, stores what the later stages need (``recv_x``, ``handle``, ...) in ``state`` and
    returns the hook. ``name`` pairs it with its ``Recv(name)``.
    """

    name: str
    fn: Callable[[Any], RecvHook]

    def __repr__(self) -> str:
        return f"Send({self.name!r})"


@dataclass(frozen=True)
class Recv:
    """Receive phase: runs the hook returned by this micro-batch's oldest pending ``Send(name)``."""

    name: str

    def __repr__(self) -> str:
        return f"Recv({self.name!r})"


Stage = Callable[[Any], None] | Send | Recv | _Yield


def _label(index: int, entry: Any) -> str:
    if isinstance(entry, (Send, Recv)):
        return f"stages[{index}] {entry!r}"
    return f"stages[{index}] {getattr(entry, '__name__', type(entry).__name__)}"


@dataclass
class _Pending:
    micro_batch: int
    name: str
    label: str
    hook: RecvHook | None = None


class MicroBatchOverlap:
    """Round-robin scheduler of ``num_micro_batches`` micro-batches over one stage list.

    Args:
        stages: callables (compute, ``fn(state) -> None``), ``Send``, ``Recv`` and ``YIELD`` entries; ``YIELD``
            splits the list into segments (none may be empty).
        num_micro_batches: 1 = the plain path (no overlap), 2 = dual-batch overlap; more are allowed when the
            order keeps at most ``NUM_LOW_LATENCY_BUFFERS`` (2) low-latency calls in flight.
        stagger: micro-batch ``j`` starts ``j * stagger`` segments after micro-batch 0.

    Rules, checked here against the fixed execution order (``DBOScheduleError`` names the micro-batch and stage):

    * every ``Recv(name)`` has a pending ``Send(name)`` of its micro-batch; a second ``Recv`` of an already received
      send is "hook called twice";
    * in order: hooks run in the order their sends were issued, across all micro-batches. The Buffer gives its
      two buffer halves to low-latency calls in turn, so with a newer call received before an older one the next
      call would reuse the older call's half while its data is still unread;
    * at most ``NUM_LOW_LATENCY_BUFFERS`` sends are pending when a ``Send`` runs (the Buffer itself raises on a
      third pending hook, without saying which micro-batch or stage caused it);
    * every send is received by the end of the list.

    Every low-latency call of the step must go through a ``Send`` (a call outside the scheduler also takes a
    buffer half), and every rank must run the same stage list with the same number of micro-batches: low-latency
    calls are collective.
    """

    def __init__(self, stages: Sequence[Stage], num_micro_batches: int = 2, stagger: int = 0):
        if isinstance(num_micro_batches, bool) or not isinstance(num_micro_batches, int) or num_micro_batches < 1:
            raise ValueError(f"num_micro_batches: expected an int >= 1, got {num_micro_batches!r}")
        if isinstance(stagger, bool) or not isinstance(stagger, int) or stagger < 0:
            raise ValueError(f"stagger: expected an int >= 0, got {stagger!r}")
        self.num_micro_batches = num_micro_batches
        self.stagger = stagger
        self.segments = self._split(stages)
        # (micro-batch, segment) in execution order: the whole schedule, decided before anything runs.
        self.order: tuple[tuple[int, int], ...] = tuple(
            (mb, tick - mb * stagger)
            for tick in range(len(self.segments) + stagger * (num_micro_batches - 1))
            for mb in range(num_micro_batches)
            if 0 <= tick - mb * stagger < len(self.segments)
        )
        self._check_order()

    @staticmethod
    def _split(stages: Sequence[Stage]) -> list[list[tuple[int, Any]]]:
        if isinstance(stages, (str, bytes)) or not isinstance(stages, Sequence):
            raise TypeError(f"stages: expected a list of stages, got {type(stages).__name__}")
        segments: list[list[tuple[int, Any]]] = [[]]
        for index, entry in enumerate(stages):
            if entry is YIELD:
                if not segments[-1]:
                    where = "starts with YIELD" if index == 0 else "has two YIELDs in a row"
                    raise ValueError(
                        f"stages[{index}]: the stage list {where}; every segment between YIELDs needs "
                        "at least one stage"
                    )
                segments.append([])
            elif isinstance(entry, Send):
                if not callable(entry.fn):
                    raise TypeError(f"stages[{index}] {entry!r}: fn must be callable, got {type(entry.fn).__name__}")
                segments[-1].append((index, entry))
            elif isinstance(entry, Recv) or callable(entry):
                segments[-1].append((index, entry))
            else:
                raise TypeError(
                    f"stages[{index}]: expected a callable, Send, Recv or YIELD, got {type(entry).__name__} ({entry!r})"
                )
        if not segments[-1]:
            if len(segments) == 1:
                raise ValueError("stages: the stage list is empty")
            raise ValueError(
                f"stages[{len(stages) - 1}]: the stage list ends with YIELD; every segment between "
                "YIELDs needs at least one stage"
            )
        return segments

    def _check_order(self) -> None:
        """Simulate the schedule once; raise on the first rule it breaks."""
        pending: deque[_Pending] = deque()
        received: dict[tuple[int, str], str] = {}  # (micro-batch, name) -> label of the last Recv that ran it
        for mb, seg in self.order:
            for index, entry in self.segments[seg]:
                where = f"micro-batch {mb}, {_label(index, entry)}"
                if isinstance(entry, Send):
                    if len(pending) >= NUM_LOW_LATENCY_BUFFERS:
                        waiting = ", ".join(f"micro-batch {p.micro_batch} {p.label}" for p in pending)
                        raise DBOScheduleError(
                            f"{where}: would put a third low-latency call in flight while {waiting} still wait for "
                            f"their receive; the Buffer has only {NUM_LOW_LATENCY_BUFFERS} low-latency buffer halves. "
                            "Put a Recv of an earlier send before this Send, use fewer micro-batches, or stagger them"
                        )
                    pending.append(_Pending(mb, entry.name, _label(index, entry)))
                elif isinstance(entry, Recv):
                    mine = [p for p in pending if p.micro_batch == mb]
                    if not any(p.name == entry.name for p in mine):
                        if (mb, entry.name) in received:
                            raise DBOScheduleError(
                                f"{where}: hook called twice: this micro-batch's Send({entry.name!r}) was already "
                                f"received by {received[(mb, entry.name)]}; each hook runs exactly once"
                            )
                        raise DBOScheduleError(
                            f"{where}: no pending Send({entry.name!r}) of this micro-batch to "
                            "receive; a Recv must follow its Send"
                        )
                    if mine[0].name != entry.name:
                        raise DBOScheduleError(
                            f"{where}: out of order: this micro-batch's older {mine[0].label} is still pending; "
                            "receives run in the order their sends were issued"
                        )
                    if pending[0] is not mine[0]:
                        raise DBOScheduleError(
                            f"{where}: out of order: micro-batch {pending[0].micro_batch}'s {pending[0].label} was "
                            "issued earlier and is still pending; receives run in the order sends were issued across "
                            "micro-batches (the Buffer gives its two buffer halves to calls in turn, so the next call "
                            "would overwrite the older call's unread half)"
                        )
                    pending.popleft()
                    received[(mb, entry.name)] = _label(index, entry)
        if pending:
            left = ", ".join(f"micro-batch {p.micro_batch} {p.label}" for p in pending)
            raise DBOScheduleError(
                f"stages: {left} never received: add the matching Recv before the end of the list "
                "(a pending hook keeps its buffer half busy)"
            )

    def run(self, states: Sequence[Any]) -> None:
        """Run the schedule; ``states[j]`` is micro-batch ``j``'s state, passed to each of its stages.

        ``states`` holds ``num_micro_batches`` objects the stages read and update in place (e.g. dicts with
        ``x: [num_tokens_j, hidden] bfloat16``); how a batch is split is the caller's choice (``torch.tensor_split``
        keeps each token's math unchanged). No host sync, no data-dependent branching: capturable in a CUDA graph
        when the stages are.
        """
        if isinstance(states, (str, bytes)) or not isinstance(states, Sequence):
            raise TypeError(
                f"states: expected a sequence of {self.num_micro_batches} micro-batch states, got "
                f"{type(states).__name__}"
            )
        if len(states) != self.num_micro_batches:
            raise ValueError(
                f"states: expected {self.num_micro_batches} micro-batch states (num_micro_batches), got {len(states)}"
            )
        pending: deque[_Pending] = deque()
        issued: list[tuple[RecvHook, str]] = []  # every hook of this run, held so that ids stay unique
        for mb, seg in self.order:
            state = states[mb]
            for index, entry in self.segments[seg]:
                if isinstance(entry, Send):
                    hook = entry.fn(state)
                    where = f"micro-batch {mb}, {_label(index, entry)}"
                    if not callable(hook):
                        raise TypeError(
                            f"{where}: fn must return the receive hook of a low-latency call made with "
                            f"return_recv_hook=True, got {type(hook).__name__}"
                        )
                    for old, old_where in issued:
                        if old is hook:
                            raise DBOScheduleError(
                                f"{where}: hook called twice: fn returned the hook already returned by {old_where}; "
                                "return the hook of the low-latency call made in this stage"
                            )
                    issued.append((hook, where))
                    pending.append(_Pending(mb, entry.name, where, hook))
                elif isinstance(entry, Recv):
                    waiting = pending.popleft()  # _check_order proved it is this micro-batch's Send(entry.name)
                    try:
                        waiting.hook()
                    except RuntimeError as e:
                        raise DBOScheduleError(
                            f"micro-batch {mb}, {_label(index, entry)}: the receive hook of {waiting.label} failed: {e}"
                        ) from e
                else:
                    entry(state)

    def __repr__(self) -> str:
        return (
            f"MicroBatchOverlap({len(self.segments)} segments, num_micro_batches={self.num_micro_batches}, "
            f"stagger={self.stagger})"
        )
