"""Handles: what a dispatch hands to the matching combine (and to cached dispatches).

A handle belongs to the ``Buffer`` that made it (``buffer_id``); passing it to another buffer is an error.

Each handle is also a tuple laid out as DeepEP v1.2.1's (so code that indexes or unpacks DeepEP's handles runs
unchanged): same length, and every element in DeepEP's position. Elements our design has are the real thing;
elements it has no counterpart for (DeepEP's per-channel ring-buffer matrices and ring heads: our engines write each
row straight to its final place, with no channels) are *stand-ins*, computed on first access from the real fields
with the meaning each docstring below states, so that a handle costs nothing extra on the hot path. The typed
fields (``handle.rank_prefix_matrix``, ``handle.recv_src_idx``, ...) are what our own code reads;
``backend_state`` is a frozen dataclass of the backend engine that made the handle (``ReferenceDispatchState``,
``IntranodeState``, ``InternodeState``, ``LowLatencyState``, ...: what its cached dispatches and combine reuse),
opaque to callers.

Handles are not changed after a backend returns them (the stand-ins cache aside): a backend that needs another
view of a handle makes a new one (``DispatchHandle.with_backend_state``), and whether a low-latency handle's receive
phase has run is tracked by the ``Buffer`` (``low_latency_state.LowLatencyCalls``), not stored in the handle.

Tuple behaviour: ``len``, indexing (also negative and slices), iteration and unpacking, ``isinstance(h, tuple)``.
Two handles compare equal only if they are the same object (their elements are tensors).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Callable, Optional, Tuple

import torch

if TYPE_CHECKING:  # expert_major imports nothing from here; the annotation only
    from .expert_major import ExpertMajorLayout


class _TupleHandle(tuple):
    """A tuple of DeepEP's layout whose stand-in elements are computed on first access.

    The underlying tuple storage is empty: every tuple operation is answered from ``_items()``. Subclasses set
    attributes in ``__init__`` and list DeepEP's element names in ``deepep_names``.
    """

    deepep_names: Tuple[str, ...] = ()

    def __new__(cls, *args, **kwargs):
        return super().__new__(cls, ())

    def _element(self, index: int):
        raise NotImplementedError

    def _items(self) -> tuple:
        cache = self.__dict__.setdefault("_cached_items", {})
        for i in range(len(self.deepep_names)):
            if i not in cache:
                cache[i] = self._element(i)
        return tuple(cache[i] for i in range(len(self.deepep_names)))

    def __len__(self) -> int:
        return len(self.deepep_names)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return tuple(self[i] for i in range(*index.indices(len(self))))
        n = len(self)
        if not isinstance(index, int) or isinstance(index, bool):
            raise TypeError(f"handle indices must be integers or slices, not {type(index).__name__}")
        if not -n <= index < n:
            raise IndexError(f"handle index {index} out of range (DeepEP's handle has {n} items)")
        index %= n
        cache = self.__dict__.setdefault("_cached_items", {})
        if index not in cache:
            cache[index] = self._element(index)
        return cache[index]

    def __iter__(self):
        return (self[i] for i in range(len(self)))

    def __contains__(self, item) -> bool:
        return any(item is element for element in self)

    def __eq__(self, other) -> bool:
        return self is other

    def __ne__(self, other) -> bool:
        return self is not other

    __hash__ = object.__hash__

    def __add__(self, other):
        return self._items() + tuple(other)

    def __radd__(self, other):
        return tuple(other) + self._items()

    def __mul__(self, count):
        return self._items() * count

    __rmul__ = __mul__

    def index(self, value, *args) -> int:
        return self._items().index(value, *args)

    def count(self, value) -> int:
        return self._items().count(value)

    def __getnewargs__(self):
        return ()

    def __reduce__(self):
        raise TypeError(f"{type(self).__name__} cannot be pickled: it refers to one Buffer's device memory")

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={_short(v)}" for k, v in vars(self).items() if not k.startswith("_"))
        return f"{type(self).__name__}({fields})"


def _short(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"tensor{list(value.shape)}:{str(value.dtype).replace('torch.', '')}"
    if isinstance(value, dict):
        return "{...}"
    if dataclasses.is_dataclass(value):
        return f"{type(value).__name__}(...)"
    return repr(value)


def send_positions(is_token_in_rank: torch.Tensor) -> torch.Tensor:
    """``[num_tokens, n] int32``: the position of each token among this rank's tokens sent to column ``j`` (its row
    offset inside this rank's block at the receiver), ``-1`` where it is not sent."""
    sent = is_token_in_rank.to(torch.int32)
    return torch.where(is_token_in_rank, torch.cumsum(sent, 0, dtype=torch.int32) - sent, -1).to(torch.int32)


class DispatchHandle(_TupleHandle):
    """Layout of one high-throughput dispatch.

    Typed fields:
        rank_prefix_matrix: ``[num_ranks, num_ranks] int32``; entry ``[i, j]`` = tokens ranks ``0..i`` send to rank
            ``j``. Column ``rank`` gives where each source rank's tokens end in ``recv_x``.
        recv_src_idx: ``[num_recv_rows] int32``, index of each received token on its source rank.
        is_token_in_rank: ``[num_tokens, num_ranks] bool``, this rank's send pattern.
        num_recv_tokens: rows of ``recv_x`` that hold tokens; ``-1`` with ``num_worst_tokens`` (knowing it would need
            a host sync: read ``rank_prefix_matrix[-1, rank]`` on the device instead). Rows past it are padding:
            ``recv_topk_idx == -1``, weight 0, ``recv_src_idx == -1``, ``recv_x`` unspecified.
        num_recv_tokens_per_expert: ``[num_local_experts] int32`` device tensor, counts rounded up to
            ``expert_alignment`` (``None`` when dispatched without ``num_tokens_per_expert``); read it instead of the
            host list to avoid a host sync.
        rank, num_ranks_per_node: of the backend that made it (``rank = -1``: unknown, the tuple view then refuses the
            stand-ins that need it).
        expert_major: ``None``, or the ``ExpertMajorLayout`` (frozen) of a ``dispatch(..., expert_major=True)`` (fused
            permute): its ``recv_x`` was expert-major ``[M, hidden]``, so is a cached dispatch's output with this
            handle, and ``combine`` takes an expert-major ``[M, hidden]`` input (see ``ep_dispatcher/expert_major.py``).
            Set at construction (``with_expert_major`` makes a new handle); a returned handle is not mutated.

    As a tuple, within one node (DeepEP's intranode handle, 6 items):
        0 ``rank_prefix_matrix`` (real);
        1 ``channel_prefix_matrix`` stand-in ``[num_ranks, 1] int32``: tokens this rank sends to each rank, as one
          channel's inclusive prefix (our engine has no channels);
        2 ``recv_channel_prefix_matrix`` stand-in ``[num_ranks, 1] int32``: row of ``recv_x`` where each source
          rank's tokens start (one channel);
        3 ``recv_src_idx`` (real);
        4 ``is_token_in_rank`` (real);
        5 ``send_head`` stand-in ``[num_tokens, num_ranks] int32``: the token's row offset inside this rank's block at
          each destination rank, ``-1`` where it is not sent (DeepEP: the token's ring-buffer slot there).
    When the group spans nodes (DeepEP's internode handle, 10 items):
        0 ``is_token_in_rank`` (real);
        1 ``rdma_channel_prefix_matrix`` stand-in ``[num_nodes, 1] int32``: tokens this rank sends to each node;
        2 ``gbl_channel_prefix_matrix`` stand-in ``[num_ranks, 1] int32``: tokens this rank sends to each rank;
        3 ``recv_rdma_channel_prefix_matrix`` stand-in ``[num_nodes, 1] int32``: tokens this rank receives from each
          node's ranks (our engine forwards every row to its final rank, no per-node receiver);
        4 ``recv_rdma_rank_prefix_sum`` stand-in ``[num_nodes] int32``: inclusive prefix sum of item 3;
        5 ``recv_gbl_channel_prefix_matrix`` stand-in ``[num_ranks, 1] int32``: row where each source rank's tokens
          start;
        6 ``recv_gbl_rank_prefix_sum`` (real) ``[num_ranks] int32``: inclusive prefix sum of the tokens received from
          ranks ``0..i`` (= ``rank_prefix_matrix[:, rank]``);
        7 ``recv_src_meta`` stand-in: ``recv_src_idx`` (DeepEP: packed source node and NVLink bitmap);
        8 ``send_rdma_head`` stand-in ``[num_tokens, num_nodes] int32``: the token's position among this rank's
          tokens sent to each node, ``-1`` where it is not sent;
        9 ``send_nvl_head`` stand-in ``[num_recv_rows, num_ranks_per_node] int32``: the receive row at this rank's
          local index, ``-1`` elsewhere (no second NVLink hop is recorded).
    """

    intranode_names = (
        "rank_prefix_matrix",
        "channel_prefix_matrix",
        "recv_channel_prefix_matrix",
        "recv_src_idx",
        "is_token_in_rank",
        "send_head",
    )
    internode_names = (
        "is_token_in_rank",
        "rdma_channel_prefix_matrix",
        "gbl_channel_prefix_matrix",
        "recv_rdma_channel_prefix_matrix",
        "recv_rdma_rank_prefix_sum",
        "recv_gbl_channel_prefix_matrix",
        "recv_gbl_rank_prefix_sum",
        "recv_src_meta",
        "send_rdma_head",
        "send_nvl_head",
    )

    def __init__(
        self,
        buffer_id: int,
        num_ranks: int,
        rank_prefix_matrix: torch.Tensor,
        recv_src_idx: torch.Tensor,
        is_token_in_rank: torch.Tensor,
        num_recv_tokens: int,
        num_recv_tokens_per_expert: Optional[torch.Tensor],
        num_worst_tokens: int = 0,
        expert_alignment: int = 1,
        backend_state: Any = None,
        rank: int = -1,
        num_ranks_per_node: Optional[int] = None,
        expert_major: Optional["ExpertMajorLayout"] = None,
    ):
        self.buffer_id = buffer_id
        self.num_ranks = num_ranks
        self.rank_prefix_matrix = rank_prefix_matrix
        self.recv_src_idx = recv_src_idx
        self.is_token_in_rank = is_token_in_rank
        self.num_recv_tokens = num_recv_tokens
        self.num_recv_tokens_per_expert = num_recv_tokens_per_expert
        self.num_worst_tokens = num_worst_tokens
        self.expert_alignment = expert_alignment
        self.backend_state = backend_state
        self.rank = rank
        self.num_ranks_per_node = num_ranks if num_ranks_per_node is None else num_ranks_per_node
        self.expert_major = expert_major

    def with_backend_state(self, backend_state: Any) -> "DispatchHandle":
        """A new handle with the same layout and another ``backend_state`` (this one is left as it is)."""
        return self._copy(backend_state=backend_state)

    def with_expert_major(self, expert_major: Optional["ExpertMajorLayout"]) -> "DispatchHandle":
        """A new handle with the same layout and state whose receive rows are ``expert_major``'s (fused permute)."""
        return self._copy(expert_major=expert_major)

    def _copy(self, **changes: Any) -> "DispatchHandle":
        fields = dict(
            buffer_id=self.buffer_id,
            num_ranks=self.num_ranks,
            rank_prefix_matrix=self.rank_prefix_matrix,
            recv_src_idx=self.recv_src_idx,
            is_token_in_rank=self.is_token_in_rank,
            num_recv_tokens=self.num_recv_tokens,
            num_recv_tokens_per_expert=self.num_recv_tokens_per_expert,
            num_worst_tokens=self.num_worst_tokens,
            expert_alignment=self.expert_alignment,
            backend_state=self.backend_state,
            rank=self.rank,
            num_ranks_per_node=self.num_ranks_per_node,
            expert_major=self.expert_major,
        )
        fields.update(changes)
        return DispatchHandle(**fields)

    @property
    def deepep_names(self) -> Tuple[str, ...]:  # type: ignore[override]
        return self.internode_names if self.is_internode else self.intranode_names

    @property
    def is_internode(self) -> bool:
        return self.num_ranks > self.num_ranks_per_node

    @property
    def num_tokens(self) -> int:
        return self.is_token_in_rank.size(0)

    @property
    def num_recv_rows(self) -> int:
        """Rows of ``recv_x`` (and of combine's input): ``num_worst_tokens`` when set, else ``num_recv_tokens``."""
        return self.num_worst_tokens if self.num_worst_tokens > 0 else self.num_recv_tokens

    # ---- stand-ins (see the class docstring); computed on first access only
    def _received_from(self) -> torch.Tensor:
        """``[num_ranks] int32``: tokens this rank receives from each rank."""
        self._need_rank()
        column = self.rank_prefix_matrix[:, self.rank]
        return torch.diff(column, prepend=column.new_zeros(1)).to(torch.int32)

    def _recv_starts(self) -> torch.Tensor:
        self._need_rank()
        column = self.rank_prefix_matrix[:, self.rank]
        return (column - self._received_from()).to(torch.int32)

    def _need_rank(self) -> None:
        if self.rank < 0:
            raise RuntimeError("handle: this handle's rank is unknown (it was not returned by Buffer.dispatch)")

    def _element(self, index: int):
        name = self.deepep_names[index]
        getter: Callable[[], Any] = getattr(self, f"_get_{name}", None) or (lambda: getattr(self, name))
        return getter()

    def _get_channel_prefix_matrix(self):
        return self.is_token_in_rank.sum(0, dtype=torch.int32).view(-1, 1)

    _get_gbl_channel_prefix_matrix = _get_channel_prefix_matrix

    def _get_recv_channel_prefix_matrix(self):
        return self._recv_starts().view(-1, 1)

    _get_recv_gbl_channel_prefix_matrix = _get_recv_channel_prefix_matrix

    def _get_send_head(self):
        return send_positions(self.is_token_in_rank)

    def _nodes(self) -> int:
        return self.num_ranks // self.num_ranks_per_node

    def _in_node(self) -> torch.Tensor:
        return self.is_token_in_rank.view(self.num_tokens, self._nodes(), self.num_ranks_per_node).any(2)

    def _get_rdma_channel_prefix_matrix(self):
        return self._in_node().sum(0, dtype=torch.int32).view(-1, 1)

    def _get_recv_rdma_channel_prefix_matrix(self):
        return self._received_from().view(self._nodes(), self.num_ranks_per_node).sum(1, dtype=torch.int32).view(-1, 1)

    def _get_recv_rdma_rank_prefix_sum(self):
        return torch.cumsum(self._get_recv_rdma_channel_prefix_matrix().view(-1), 0, dtype=torch.int32)

    def _get_recv_gbl_rank_prefix_sum(self):
        self._need_rank()
        return self.rank_prefix_matrix[:, self.rank]

    def _get_recv_src_meta(self):
        return self.recv_src_idx

    def _get_send_rdma_head(self):
        return send_positions(self._in_node())

    def _get_send_nvl_head(self):
        self._need_rank()
        rows = self.recv_src_idx.size(0)
        head = torch.full((rows, self.num_ranks_per_node), -1, dtype=torch.int32, device=self.recv_src_idx.device)
        row_ids = torch.arange(rows, dtype=torch.int32, device=head.device)
        head[:, self.rank % self.num_ranks_per_node] = torch.where(self.recv_src_idx >= 0, row_ids, -1)
        return head


class LowLatencyHandle(_TupleHandle):
    """Layout of one low-latency dispatch (expert-major, ``num_ranks * num_max_dispatch_tokens_per_rank`` slots
    per local expert).

    src_info: ``[num_local_experts, num_ranks * max_tokens] int32``, source token index of each filled slot
        (``-1`` in unfilled slots).
    layout_range: ``[num_local_experts, num_ranks] int64``; ``(begin << 32) | count`` of the slots of each
        (local expert, source rank) pair; ranges are in source-rank order.

    As a tuple (DeepEP's low-latency handle, 5 items, all real): ``(src_info, layout_range,
    num_max_dispatch_tokens_per_rank, hidden, num_experts)``.
    """

    deepep_names = ("src_info", "layout_range", "num_max_dispatch_tokens_per_rank", "hidden", "num_experts")

    def __init__(
        self,
        buffer_id: int,
        src_info: torch.Tensor,
        layout_range: torch.Tensor,
        num_max_dispatch_tokens_per_rank: int,
        hidden: int,
        num_experts: int,
        num_tokens: int,
        num_topk: int,
        backend_state: Any = None,
    ):
        self.buffer_id = buffer_id
        self.src_info = src_info
        self.layout_range = layout_range
        self.num_max_dispatch_tokens_per_rank = num_max_dispatch_tokens_per_rank
        self.hidden = hidden
        self.num_experts = num_experts
        self.num_tokens = num_tokens
        self.num_topk = num_topk
        self.backend_state = backend_state

    def _element(self, index: int):
        return getattr(self, self.deepep_names[index])
