"""Host-side pieces of the CUDA backend that run without a GPU: the internode send positions, the routing between
the engines and the reference backend it holds."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ep_dispatcher.backends.base import CombineArgs
from ep_dispatcher.handles import DispatchHandle, LowLatencyHandle

cuda_backend = pytest.importorskip("ep_dispatcher.backends.cuda", exc_type=ImportError)


@pytest.mark.parametrize("num_tokens,num_ranks,per_node", [(0, 4, 2), (1, 4, 2), (37, 8, 4), (50, 8, 2), (9, 6, 3)])
def test_internode_send_positions_match_a_loop(num_tokens: int, num_ranks: int, per_node: int) -> None:
    g = torch.Generator().manual_seed(num_tokens * 31 + num_ranks)
    in_rank = torch.rand((num_tokens, num_ranks), generator=g) < 0.35
    send_pos, rdma_send_pos, per_rank, per_node_counts = cuda_backend.internode_send_positions(in_rank, per_node)
    num_nodes = num_ranks // per_node
    assert send_pos.dtype == rdma_send_pos.dtype == per_rank.dtype == per_node_counts.dtype == torch.int32
    assert send_pos.shape == (num_tokens, num_ranks) and rdma_send_pos.shape == (num_tokens, num_nodes)
    rank_seen, node_seen = [0] * num_ranks, [0] * num_nodes
    for t in range(num_tokens):
        for r in range(num_ranks):
            expected = rank_seen[r] if in_rank[t, r] else -1
            rank_seen[r] += int(in_rank[t, r])
            assert int(send_pos[t, r]) == expected
        for n in range(num_nodes):
            hit = bool(in_rank[t, n * per_node : (n + 1) * per_node].any())
            assert int(rdma_send_pos[t, n]) == (node_seen[n] if hit else -1)
            node_seen[n] += int(hit)
    assert per_rank.tolist() == rank_seen and per_node_counts.tolist() == node_seen


class _FakeEngine:
    """Stands for an engine in the routing table: it claims the handles whose state is ``owned``."""

    combine_dtypes = cuda_backend.COMBINE_DTYPES

    def __init__(self, owned: type):
        self.owned = owned

    def made(self, state: object) -> bool:
        return isinstance(state, self.owned)


def _handle(state) -> DispatchHandle:
    in_rank = torch.tensor([[True], [False], [True]])
    return DispatchHandle(
        buffer_id=1,
        num_ranks=1,
        rank_prefix_matrix=torch.tensor([[2]], dtype=torch.int32),
        recv_src_idx=torch.tensor([0, 2], dtype=torch.int32),
        is_token_in_rank=in_rank,
        num_recv_tokens=2,
        num_recv_tokens_per_expert=None,
        backend_state=state,
        rank=0,
        num_ranks_per_node=1,
    )


def test_backends_follow_the_interface(group) -> None:
    from ep_dispatcher.backends.base import Backend
    from ep_dispatcher.backends.reference import ReferenceBackend

    assert isinstance(ReferenceBackend(group, 0, 1, 1), Backend)
    assert isinstance(cuda_backend.CudaBackend(group, 0, 1, 1), Backend)


def test_low_latency_routing(group) -> None:
    """The decode calls route through ``_route_on`` (``tensor.is_cuda``, no ``device.type``): the same answers as
    ``_route`` for every call, and the low-latency engine only for GPU tensors and handles it made."""
    from ep_dispatcher.backends.reference import ReferenceLowLatencyState

    backend = cuda_backend.CudaBackend(group, 0, 1, 1)
    engine = backend.low_latency = _FakeEngine(cuda_backend.LowLatencyState)
    assert backend.engine_calls() == ("get_dispatch_layout", "low_latency_dispatch", "low_latency_combine")
    for call in backend._engines():
        for device in (torch.device("cuda", 0), torch.device("cpu")):
            assert backend._route_on(call, device.type == "cuda") is backend._route(call, device), (call, device)
    assert backend._route_on("low_latency_dispatch", True) is engine
    assert backend._route_on("low_latency_dispatch", False) is None, "CPU tensors: the reference"
    mine = LowLatencyHandle(1, None, None, 4, 128, 8, 2, 2, cuda_backend.LowLatencyState(torch.zeros(4)))
    theirs = LowLatencyHandle(1, None, None, 4, 128, 8, 2, 2, ReferenceLowLatencyState(None, None, [], [], None))
    assert backend._route_on("low_latency_combine", True, mine) is engine
    assert backend._route_on("low_latency_combine", True, theirs) is None, "a handle the reference made"


def test_routing_falls_back_to_the_reference_in_one_place(group, monkeypatch) -> None:
    """Which engine serves a call: no GPU needed, the routing is host logic (engines stood in for by fakes)."""
    from ep_dispatcher.backends.reference import ReferenceDispatchState

    monkeypatch.setenv("EP_DISPATCHER_FUSED_EXPERT_MAJOR", "0")  # the fused calls: the test below

    backend = cuda_backend.CudaBackend(group, 0, 1, 1)  # no bytes: no engine but the layout kernel
    assert backend.engine_calls() == ("get_dispatch_layout",)
    gpu, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert backend._route("dispatch", gpu) is None and backend._route("get_dispatch_layout", cpu) is None
    assert backend._route("get_dispatch_layout", gpu) is backend.layout

    engine = backend.intranode = _FakeEngine(cuda_backend.IntranodeState)
    assert backend.engine_calls() == ("get_dispatch_layout", "dispatch", "cached_dispatch", "combine")
    state = cuda_backend.IntranodeState(
        count_matrix=torch.tensor([[2]], dtype=torch.int32),
        count_matrix_host=None,
        send_pos=torch.tensor([[0], [-1], [1]], dtype=torch.int32),
        sent_rows=None,
        most_sent=2,
    )
    engine_handle = _handle(state)
    assert backend._route("dispatch", gpu) is engine
    assert backend._route("dispatch", cpu) is None, "CPU tensors: the reference"
    for dtype in (torch.bfloat16, torch.float32):
        assert backend._route("combine", gpu, handle=engine_handle, dtype=dtype) is engine
    for dtype in (torch.float16, torch.float64):
        assert backend._route("combine", gpu, handle=engine_handle, dtype=dtype) is None, f"{dtype}: the reference"
    reference_handle = _handle(ReferenceDispatchState(torch.tensor([0, 2]), [2], [2], 2))
    assert backend._route("cached_dispatch", gpu, handle=reference_handle) is None, "a handle the reference made"

    # The reference view of an engine handle is a new handle; the engine's handle is left as it was.
    view = cuda_backend.reference_view(engine_handle, rank=0)
    assert view is not engine_handle and engine_handle.backend_state is state
    assert isinstance(view.backend_state, ReferenceDispatchState)
    assert view.backend_state.send_idx.tolist() == [0, 2] and view.backend_state.num_recv == 2
    assert view.backend_state.send_counts == [2] and view.backend_state.recv_counts == [2]
    assert cuda_backend.reference_view(reference_handle, rank=0) is reference_handle

    # fp16 / fp64 combine through the routing equals the reference's, on the same handle.
    g = torch.Generator().manual_seed(17)
    for dtype in (torch.float16, torch.float64):
        y = torch.randn((2, 8), generator=g).to(dtype)
        expected, _ = backend.reference.combine(CombineArgs(y, view))
        combined, _ = backend.combine(CombineArgs(y, engine_handle))
        assert torch.equal(combined, expected) and combined.dtype == dtype


def test_fused_expert_major_is_routed_only_when_switched_on(group, monkeypatch) -> None:
    """EP_DISPATCHER_FUSED_EXPERT_MAJOR (read per call) puts the fused expert-major dispatch, cached dispatch and
    combine on the intranode engine; the cached dispatch and the combine only for a handle the fused dispatch made
    (its state keeps the pair table), the combine only for a dtype the engine sums."""
    backend = cuda_backend.CudaBackend(group, 0, 1, 1)
    gpu = torch.device("cuda", 0)
    engine = backend.intranode = _FakeEngine(cuda_backend.IntranodeState)
    fused_calls = ("dispatch_expert_major", "cached_dispatch_expert_major", "combine_expert_major")
    monkeypatch.setenv("EP_DISPATCHER_FUSED_EXPERT_MAJOR", "0")
    assert backend.engine_calls() == ("get_dispatch_layout", "dispatch", "cached_dispatch", "combine"), "switched off"
    assert backend._route("dispatch_expert_major", gpu) is None
    monkeypatch.delenv("EP_DISPATCHER_FUSED_EXPERT_MAJOR", raising=False)
    assert backend.engine_calls() == ("get_dispatch_layout", "dispatch", "cached_dispatch", "combine", *fused_calls), (
        "on by default"
    )
    monkeypatch.setenv("EP_DISPATCHER_FUSED_EXPERT_MAJOR", "1")
    assert backend.engine_calls() == ("get_dispatch_layout", "dispatch", "cached_dispatch", "combine", *fused_calls)
    assert backend._route("dispatch_expert_major", gpu) is engine
    assert backend._route("dispatch_expert_major", torch.device("cpu")) is None, "CPU tensors: the reference"
    state = cuda_backend.IntranodeState(
        count_matrix=torch.tensor([[2]], dtype=torch.int32),
        count_matrix_host=None,
        send_pos=torch.tensor([[0], [-1], [1]], dtype=torch.int32),
        sent_rows=None,
        most_sent=2,
    )
    assert state.expert_pairs is None and state.expert_table is None, "a received-order dispatch's state"
    assert backend._route("cached_dispatch_expert_major", gpu, handle=_handle(state)) is engine
    for call in fused_calls[1:]:
        assert backend._fused_handle(call, gpu, _handle(state)) is None, f"{call}: a received-order state: the fallback"
    fused_state = dataclasses.replace(
        state, expert_pairs=torch.full((2, 3, 1), -1, dtype=torch.int32), expert_table=torch.zeros(3, dtype=torch.int32)
    )
    for call in fused_calls[1:]:
        assert backend._fused_handle(call, gpu, _handle(fused_state)) is engine, call
        assert backend._fused_handle(call, torch.device("cpu"), _handle(fused_state)) is None, f"{call}: CPU tensors"
    assert backend._fused_handle("combine_expert_major", gpu, _handle(fused_state), dtype=torch.bfloat16) is engine
    assert backend._fused_handle("combine_expert_major", gpu, _handle(fused_state), dtype=torch.float16) is None, "fp16"
    backend.internode = _FakeEngine(cuda_backend.InternodeState)
    assert backend._route("dispatch_expert_major", gpu) is None, "no fused kernel on the internode engine"
    monkeypatch.setenv("EP_DISPATCHER_FUSED_EXPERT_MAJOR", "0")
    backend.internode = None
    assert backend._route("cached_dispatch_expert_major", gpu, handle=_handle(state)) is None
    assert backend._fused_handle("combine_expert_major", gpu, _handle(fused_state)) is None, "switched off"
