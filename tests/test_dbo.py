"""``ep_dispatcher.dbo.MicroBatchOverlap``: execution order, bit-exact results over ``Buffer`` low-latency calls
(2 and 4 gloo ranks), every misuse error (type and message), and the ``examples/dbo_decode.py`` run."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from ep_dispatcher import Buffer
from ep_dispatcher.dbo import YIELD, DBOScheduleError, MicroBatchOverlap, Recv, Send
from tests.dist import run

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---------------------------------------------------------------- order (fake stages, no communication)
def _traced_stages(trace: list, layout: str = "after_send") -> list:
    """A one-layer stage list whose stages append ``(micro-batch, what)`` to ``trace``; hooks too."""

    def compute(what):
        def fn(state):
            trace.append((state["mb"], what))

        fn.__name__ = what
        return fn

    def send(what):
        def fn(state):
            trace.append((state["mb"], what + "_send"))
            return lambda: trace.append((state["mb"], what + "_hook"))

        return Send(what, fn)

    if layout == "after_send":
        return [
            compute("attn"),
            send("dispatch"),
            YIELD,
            Recv("dispatch"),
            compute("experts"),
            send("combine"),
            YIELD,
            Recv("combine"),
            compute("out"),
        ]
    # the layout: a YIELD on both sides of each send
    return [
        compute("attn"),
        YIELD,
        send("dispatch"),
        YIELD,
        Recv("dispatch"),
        compute("experts"),
        YIELD,
        send("combine"),
        YIELD,
        Recv("combine"),
        compute("out"),
    ]


def _run_traced(num_micro_batches: int, stagger: int = 0, layout: str = "after_send") -> list:
    trace: list = []
    MicroBatchOverlap(_traced_stages(trace, layout), num_micro_batches, stagger).run(
        [{"mb": i} for i in range(num_micro_batches)]
    )
    return trace


def test_two_micro_batches_overlap_each_send_with_the_other_compute():
    assert _run_traced(2) == [
        (0, "attn"),
        (0, "dispatch_send"),
        (1, "attn"),
        (1, "dispatch_send"),  # micro-batch 0's dispatch is in flight during micro-batch 1's attention
        (0, "dispatch_hook"),
        (0, "experts"),
        (0, "combine_send"),  # 1's dispatch in flight during 0's experts
        (1, "dispatch_hook"),
        (1, "experts"),
        (1, "combine_send"),  # 0's combine in flight during 1's experts
        (0, "combine_hook"),
        (0, "out"),
        (1, "combine_hook"),
        (1, "out"),
    ]


def test_one_micro_batch_is_the_plain_path():
    assert _run_traced(1) == [
        (0, w) for w in ("attn", "dispatch_send", "dispatch_hook", "experts", "combine_send", "combine_hook", "out")
    ]


def test_stagger_and_three_micro_batches():
    trace = _run_traced(3, stagger=1, layout="both_sides")
    assert [t for t in trace if t[1].endswith("_send") or t[1].endswith("_hook")] == [
        (0, "dispatch_send"),
        (0, "dispatch_hook"),
        (1, "dispatch_send"),
        (0, "combine_send"),
        (1, "dispatch_hook"),
        (2, "dispatch_send"),
        (0, "combine_hook"),
        (1, "combine_send"),
        (2, "dispatch_hook"),
        (1, "combine_hook"),
        (2, "combine_send"),
        (2, "combine_hook"),
    ]
    plain = [what for _, what in _run_traced(1, layout="both_sides")]
    for mb in range(3):  # each micro-batch still runs all of its stages, in its own order
        assert [what for m, what in trace if m == mb] == plain


# ---------------------------------------------------------------- misuse: found when the scheduler is built
def _noop(state) -> None:
    pass


def _send(name: str, calls: list | None = None) -> Send:
    def fn(state):
        if calls is not None:
            calls.append(name)
        return lambda: None

    return Send(name, fn)


def test_third_call_in_flight_is_refused_before_anything_runs():
    calls: list = []
    stages = [_noop, _send("dispatch", calls), YIELD, Recv("dispatch"), _noop]
    MicroBatchOverlap(stages, 2)  # two in flight: fine
    with pytest.raises(
        DBOScheduleError,
        match=r"^micro-batch 2, stages\[1\] Send\('dispatch'\): would put a third "
        r"low-latency call in flight while micro-batch 0 stages\[1\] Send\('dispatch'\), micro-batch 1 "
        r"stages\[1\] Send\('dispatch'\) still wait for their receive; the Buffer has only 2",
    ):
        MicroBatchOverlap(stages, 3)
    with pytest.raises(DBOScheduleError, match=r"micro-batch 0, stages\[2\] Send\('c'\): would put a third"):
        MicroBatchOverlap([_send("a"), _send("b"), _send("c"), Recv("a"), Recv("b"), Recv("c")], 1)
    assert calls == []


@pytest.mark.parametrize(
    "stages, num_micro_batches, pattern",
    [
        (
            [_send("dispatch"), YIELD, Recv("dispatch"), Recv("dispatch")],
            2,
            (
                r"^micro-batch 0, stages\[3\] Recv\('dispatch'\): hook called twice: this micro-batch's Send\('dispatch'\) was "  # noqa: E501
                r"already received by stages\[2\] Recv\('dispatch'\); each hook runs exactly once"
            ),
        ),
        (
            [_send("dispatch"), _send("combine"), Recv("combine"), Recv("dispatch")],
            1,
            (
                r"^micro-batch 0, stages\[2\] Recv\('combine'\): out of order: this micro-batch's older stages\[0\] "
                r"Send\('dispatch'\) is still pending; receives run in the order their sends were issued"
            ),
        ),
        (
            [_send("shared"), Recv("shared"), _send("dispatch"), YIELD, Recv("dispatch")],
            2,
            (
                r"^micro-batch 1, stages\[1\] Recv\('shared'\): out of order: micro-batch 0's stages\[2\] Send\('dispatch'\) "  # noqa: E501
                r"was issued earlier and is still pending; .*would overwrite the older call's unread half"
            ),
        ),
        (
            [Recv("dispatch"), _noop],
            2,
            r"^micro-batch 0, stages\[0\] Recv\('dispatch'\): no pending Send\('dispatch'\) of this micro-batch",
        ),
        (
            [_noop, _send("dispatch"), YIELD, _noop],
            2,
            (
                r"^stages: micro-batch 0 stages\[1\] Send\('dispatch'\), micro-batch 1 stages\[1\] Send\('dispatch'\) never "  # noqa: E501
                r"received"
            ),
        ),
    ],
)
def test_order_errors(stages, num_micro_batches, pattern):
    with pytest.raises(DBOScheduleError, match=pattern):
        MicroBatchOverlap(stages, num_micro_batches)


@pytest.mark.parametrize(
    "stages, kwargs, exc, pattern",
    [
        ([YIELD, _noop], {}, ValueError, r"^stages\[0\]: the stage list starts with YIELD"),
        ([_noop, YIELD, YIELD, _noop], {}, ValueError, r"^stages\[2\]: the stage list has two YIELDs in a row"),
        ([_noop, YIELD], {}, ValueError, r"^stages\[1\]: the stage list ends with YIELD"),
        ([], {}, ValueError, r"^stages: the stage list is empty"),
        ([_noop, 3], {}, TypeError, r"^stages\[1\]: expected a callable, Send, Recv or YIELD, got int \(3\)"),
        (
            [Send("dispatch", None)],
            {},
            TypeError,
            r"^stages\[0\] Send\('dispatch'\): fn must be callable, got NoneType",
        ),
        ("attn", {}, TypeError, r"^stages: expected a list of stages, got str"),
        ([_noop], {"num_micro_batches": 0}, ValueError, r"^num_micro_batches: expected an int >= 1, got 0"),
        ([_noop], {"stagger": -1}, ValueError, r"^stagger: expected an int >= 0, got -1"),
    ],
)
def test_bad_stage_lists(stages, kwargs, exc, pattern):
    with pytest.raises(exc, match=pattern):
        MicroBatchOverlap(stages, **kwargs)


# ---------------------------------------------------------------- misuse: found while running
def test_run_errors():
    scheduler = MicroBatchOverlap([Send("dispatch", lambda state: state.get("hook")), YIELD, Recv("dispatch")], 2)
    with pytest.raises(ValueError, match=r"^states: expected 2 micro-batch states \(num_micro_batches\), got 1"):
        scheduler.run([{}])
    with pytest.raises(TypeError, match=r"^states: expected a sequence of 2 micro-batch states, got dict"):
        scheduler.run({})
    with pytest.raises(
        TypeError,
        match=r"^micro-batch 0, stages\[0\] Send\('dispatch'\): fn must return the receive "
        r"hook of a low-latency call made with return_recv_hook=True, got NoneType",
    ):
        scheduler.run([{}, {}])
    stale = {"hook": lambda: None}  # e.g. a state dict shared by mistake: both micro-batches return one hook
    with pytest.raises(
        DBOScheduleError,
        match=r"^micro-batch 1, stages\[0\] Send\('dispatch'\): hook called twice: "
        r"fn returned the hook already returned by micro-batch 0, stages\[0\] Send\('dispatch'\)",
    ):
        scheduler.run([stale, stale])


H, E, T = 128, 8, 8


def test_hook_called_by_the_stage_itself_is_reported_with_its_stage(group):
    buffer = Buffer(
        None,
        low_latency_mode=True,
        backend="reference",
        num_rdma_bytes=Buffer.get_low_latency_rdma_size_hint(T, H, 1, E),
    )
    g = torch.Generator().manual_seed(11)
    x = torch.randn((4, H), generator=g).to(torch.bfloat16)
    topk_idx = torch.rand((4, E), generator=g).argsort(dim=1)[:, :2].contiguous()

    def dispatch_send(state):
        *_, hook = buffer.low_latency_dispatch(x, topk_idx, T, E, return_recv_hook=True)
        hook()  # the stage runs its own hook: the scheduler's Recv then runs it a second time
        return hook

    scheduler = MicroBatchOverlap([Send("dispatch", dispatch_send), YIELD, Recv("dispatch")], 1)
    with pytest.raises(
        DBOScheduleError,
        match=r"^micro-batch 0, stages\[2\] Recv\('dispatch'\): the receive hook of "
        r"micro-batch 0, stages\[0\] Send\('dispatch'\) failed: hook: already called",
    ) as info:
        scheduler.run([{}])
    assert isinstance(info.value.__cause__, RuntimeError)


# ---------------------------------------------------------------- bit-exact over Buffer, 2 and 4 ranks
def _moe_stages(
    buffer: Buffer, num_experts: int, max_tokens: int, topk: int, use_fp8: bool, scale: torch.Tensor, layout: str
) -> list:
    """Two MoE layers over ``Buffer.low_latency_*``; every op is row-wise, so any split of the batch is exact."""

    def route(state):
        x = state["x"]
        scores = x.float()[:, :num_experts] + x.float()[:, num_experts : 2 * num_experts].sin()
        weights, idx = torch.softmax(scores, -1).topk(topk, -1)
        state.update(topk_idx=idx.contiguous(), topk_weights=weights.contiguous())

    def dispatch(state):
        recv_x, _, handle, _, hook = buffer.low_latency_dispatch(
            state["x"], state["topk_idx"], max_tokens, num_experts, use_fp8=use_fp8, return_recv_hook=True
        )
        state.update(recv_x=recv_x, handle=handle)
        return hook

    def experts(state):
        recv_x = state.pop("recv_x")
        if use_fp8:
            data, scales = recv_x
            e, s, h = data.shape
            x = (data.float().view(e, s, h // 128, 128) * scales.unsqueeze(-1)).view(e, s, h)
        else:
            x = recv_x.float()
        state["y"] = torch.tanh(x * scale[:, None, None]).to(torch.bfloat16)

    def combine(state):
        out, _, hook = buffer.low_latency_combine(
            state.pop("y"), state["topk_idx"], state["topk_weights"], state.pop("handle"), return_recv_hook=True
        )
        state["moe"] = out
        return hook

    def residual(state):
        state["x"] = (state["x"].float() + state.pop("moe").float()).to(torch.bfloat16)

    if layout == "after_send":
        layer = [
            route,
            Send("dispatch", dispatch),
            YIELD,
            Recv("dispatch"),
            experts,
            Send("combine", combine),
            YIELD,
            Recv("combine"),
            residual,
        ]
    else:
        layer = [
            route,
            YIELD,
            Send("dispatch", dispatch),
            YIELD,
            Recv("dispatch"),
            experts,
            YIELD,
            Send("combine", combine),
            YIELD,
            Recv("combine"),
            residual,
        ]
    return layer + ([YIELD] if layout != "after_send" else []) + layer


def _no_hook_reference(buffer, x, num_experts, max_tokens, topk, use_fp8, scale):
    """The same two layers with plain ``low_latency_*`` calls (no hooks, no scheduler)."""
    state = {"x": x}
    stages = [
        s
        for s in _moe_stages(buffer, num_experts, max_tokens, topk, use_fp8, scale, "after_send")
        if s is not YIELD and not isinstance(s, Recv)
    ]
    for stage in stages:
        if isinstance(stage, Send):
            stage.fn(state)()
        else:
            stage(state)
    return state["x"]


def _bit_exact_rank(rank: int, world: int, seed: int) -> None:
    num_experts, max_tokens, topk = 4 * world, 12, 3
    buffer = Buffer(
        None,
        low_latency_mode=True,
        backend="reference",
        num_rdma_bytes=Buffer.get_low_latency_rdma_size_hint(max_tokens, H, world, num_experts),
    )
    scale = torch.linspace(0.5, 2.0, num_experts)[rank * 4 : (rank + 1) * 4]
    num_tokens = [max_tokens, 7, 1, 0][rank % 4]  # uneven, one micro-batch empty on rank 2, no tokens on rank 3
    g = torch.Generator().manual_seed(seed * 100 + rank)
    x = torch.randn((num_tokens, H), generator=g).to(torch.bfloat16)
    for use_fp8 in (True, False):
        expected = _no_hook_reference(buffer, x, num_experts, max_tokens, topk, use_fp8, scale)
        cases = [(1, 0, "after_send"), (2, 0, "after_send"), (2, 1, "both_sides"), (3, 1, "both_sides")]
        for num_micro_batches, stagger, layout in cases:
            stages = _moe_stages(buffer, num_experts, max_tokens, topk, use_fp8, scale, layout)
            states = [{"x": part} for part in torch.tensor_split(x, num_micro_batches)]
            MicroBatchOverlap(stages, num_micro_batches, stagger).run(states)
            got = torch.cat([s["x"] for s in states])
            # bit-exact: the split changes no token's math (row-wise ops, fixed-order fp32 combine)
            assert torch.equal(got, expected), (rank, use_fp8, num_micro_batches, stagger, layout)
        assert buffer.num_pending_low_latency_hooks == 0


@pytest.mark.parametrize("world", [2, 4])
def test_overlap_equals_plain_bit_exactly(world):
    run(_bit_exact_rank, world, 5)


# ---------------------------------------------------------------- the example
def test_example_runs_and_checks_bit_exactness():
    proc = subprocess.run(
        [
            sys.executable,
            os.path.join(REPO, "examples", "dbo_decode.py"),
            "--ranks",
            "2",
            "--tokens",
            "8",
            "--layers",
            "2",
            "--steps",
            "1",
            "--hidden",
            "128",
            "--ffn",
            "64",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "tokens/s" in proc.stdout and "plain (1 micro-batch)" in proc.stdout
    assert "max |overlap - plain| over all tokens: 0.000e+00 (must be exactly 0) -> OK" in proc.stdout


def test_example_refuses_graph_timing_without_cuda(capsys):
    sys.path.insert(0, os.path.join(REPO, "examples"))
    try:
        import dbo_decode
    finally:
        sys.path.pop(0)
    parser = dbo_decode.build_parser()
    with pytest.raises(SystemExit):
        dbo_decode.check_args(parser, parser.parse_args(["--graph", "--device", "cpu"]))
    assert "--graph needs a CUDA device" in capsys.readouterr().err
