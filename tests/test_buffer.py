"""Every bad input to ``Buffer`` raises a clear exception naming the argument; plus the small public helpers."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from ep_dispatcher import Buffer, Config, EventOverlap, per_token_cast_to_fp8
from tests.dist import run

H, E, N, K, T = 128, 8, 6, 2, 16


def _buffer(**kwargs) -> Buffer:
    defaults = dict(
        num_nvl_bytes=Config().get_nvl_buffer_size_hint(H * 2, 1),
        low_latency_mode=True,
        num_rdma_bytes=Buffer.get_low_latency_rdma_size_hint(T, H, 1, E),
        backend="reference",
    )
    defaults.update(kwargs)
    return Buffer(None, **defaults)


def _routing(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn((N, H), generator=g).to(torch.bfloat16)
    topk_idx = torch.rand((N, E), generator=g).argsort(dim=1)[:, :K].contiguous()
    topk_weights = torch.rand((N, K), generator=g)
    return x, topk_idx, topk_weights


def _layout(buf, topk_idx):
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(topk_idx, E)
    return dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)


def _dispatch(buf, x, topk_idx, topk_weights, **kwargs):
    return buf.dispatch(x, topk_idx=topk_idx, topk_weights=topk_weights, **_layout(buf, topk_idx), **kwargs)


# ---------------------------------------------------------------- construction
def test_buffer_needs_initialised_process_group():
    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    with pytest.raises(RuntimeError, match="init_process_group"):
        Buffer(None)


@pytest.mark.parametrize(
    "kwargs, exc, pattern",
    [
        (dict(backend="tpu"), ValueError, r"backend: expected one of .*got 'tpu'"),
        (dict(num_nvl_bytes=-1), ValueError, r"num_nvl_bytes: expected >= 0, got -1"),
        (dict(num_rdma_bytes=1.5), TypeError, r"num_rdma_bytes: expected an int"),
        (dict(timeout_s=0), ValueError, r"timeout_s: expected a positive number"),
        (dict(num_ranks_per_node=0), ValueError, r"num_ranks_per_node: expected >= 1"),
    ],
)
def test_bad_constructor_arguments(group, kwargs, exc, pattern):
    with pytest.raises(exc, match=pattern):
        _buffer(**kwargs)


def test_cuda_backend_explains_why_unavailable(group):
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    with pytest.raises(RuntimeError, match=r"backend='cuda' is unavailable: .*"):
        _buffer(backend="cuda")


def test_auto_backend_is_reference_without_gpu(group):
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    assert _buffer(backend="auto").backend == "reference"


# ---------------------------------------------------------------- layout
@pytest.mark.parametrize(
    "make, exc, pattern",
    [
        (lambda t: t.int(), TypeError, r"topk_idx: expected dtype torch.int64, got torch.int32"),
        (lambda t: t[:, 0], ValueError, r"topk_idx: expected shape \[\*, \*\], got \[6\]"),
        (lambda t: t.t(), ValueError, r"topk_idx: expected a contiguous tensor"),
        (
            lambda t: torch.where(t == 3, torch.full_like(t, E), t),
            ValueError,
            r"topk_idx: expected entries in \[-1, 8\) \(-1 = no expert\), got min 0, max 8",
        ),
        (lambda t: t - 2, ValueError, r"topk_idx: expected entries in \[-1, 8\).*got min -2"),
        (lambda t: t.repeat(1, 9), ValueError, r"topk_idx: expected 1 <= num_topk <= 16, got num_topk=18"),
        (lambda t: t.tolist(), TypeError, r"topk_idx: expected a torch.Tensor, got list"),
    ],
)
def test_layout_rejects_bad_topk_idx(group, make, exc, pattern):
    _, topk_idx, _ = _routing()
    with pytest.raises(exc, match=pattern):
        _buffer().get_dispatch_layout(make(topk_idx), E)


def test_layout_rejects_bad_num_experts(group):
    _, topk_idx, _ = _routing()
    with pytest.raises(TypeError, match=r"num_experts: expected an int, got float"):
        _buffer().get_dispatch_layout(topk_idx, 8.0)
    with pytest.raises(ValueError, match=r"num_experts: expected >= 1, got 0"):
        _buffer().get_dispatch_layout(topk_idx, 0)


def _two_rank_num_experts(rank: int, world: int) -> str:
    buf = Buffer(None, num_nvl_bytes=Config().get_nvl_buffer_size_hint(H * 2, world), backend="reference")
    topk_idx = torch.zeros((N, K), dtype=torch.int64)
    try:
        buf.get_dispatch_layout(topk_idx, 7)
    except ValueError as e:
        return str(e)
    return "no error"


def test_num_experts_must_divide_by_ranks():
    messages = run(_two_rank_num_experts, 2)
    assert all("num_experts: expected a multiple of the number of ranks (2), got 7" in m for m in messages), messages


# ---------------------------------------------------------------- dispatch
def test_dispatch_rejects_bad_payloads(group):
    buf = _buffer()
    x, topk_idx, topk_weights = _routing()
    layout = _layout(buf, topk_idx)
    cases = [
        (x.t(), ValueError, r"x: expected a contiguous tensor"),
        (x[:, :100], ValueError, r"x: expected a contiguous tensor"),
        (x[:, :100].contiguous(), ValueError, r"x: rows must be a multiple of 16 bytes .*hidden=100"),
        (x[:, :4].to(torch.uint8).contiguous(), ValueError, r"x: rows must be a multiple of 16 bytes .*hidden=4"),
        (
            (x.to(torch.float8_e4m3fn), torch.ones((N + 1, 2))),
            ValueError,
            r"x\[1\]: expected scales of shape \[num_tokens=6, num_scales >= 1\].*got \[7, 2\]",
        ),
        (
            (x.to(torch.float8_e4m3fn), torch.ones((N, 1), dtype=torch.float64)),
            TypeError,
            r"x\[1\]: expected dtype torch.float32 or torch.int32, got torch.float64",
        ),
        ((x.t(), torch.ones((N, 1))), ValueError, r"x\[0\]: expected a contiguous tensor"),
        ((x.to(torch.float8_e4m3fn),), ValueError, r"x: expected a tensor or a \(data, scales\) pair, got 1 items"),
    ]
    for bad_x, exc, pattern in cases:
        with pytest.raises(exc, match=pattern):
            buf.dispatch(bad_x, topk_idx=topk_idx, topk_weights=topk_weights, **layout)


def test_dispatch_rejects_bad_layout_and_topk(group):
    buf = _buffer()
    x, topk_idx, topk_weights = _routing()
    layout = _layout(buf, topk_idx)
    bad = [
        (
            dict(is_token_in_rank=layout["is_token_in_rank"].int()),
            TypeError,
            r"is_token_in_rank: expected dtype torch.bool, got torch.int32",
        ),
        (dict(is_token_in_rank=None), TypeError, r"is_token_in_rank: expected a torch.Tensor, got NoneType"),
        (
            dict(num_tokens_per_rank=layout["num_tokens_per_rank"].long()),
            TypeError,
            r"num_tokens_per_rank: expected dtype torch.int32, got torch.int64",
        ),
        (
            dict(num_tokens_per_rank=layout["num_tokens_per_rank"] + 1),
            ValueError,
            r"num_tokens_per_rank: expected is_token_in_rank.sum\(0\) = \[6\], got \[7\]",
        ),
        (
            dict(topk_weights=topk_weights.double()),
            TypeError,
            r"topk_weights: expected dtype torch.float32, got torch.float64",
        ),
        (
            dict(topk_weights=topk_weights[:, :1].contiguous()),
            ValueError,
            r"topk_weights: expected shape \[6, 2\], got \[6, 1\]",
        ),
        (
            dict(topk_weights=None),
            ValueError,
            r"topk_weights: expected a tensor \(topk_idx and topk_weights go together\)",
        ),
        (
            dict(topk_idx=topk_idx[:4].contiguous()),
            ValueError,
            r"x, topk_idx: x has 6 rows \(tokens\) but topk_idx has 4; expected one topk_idx row per token of x",
        ),
        (dict(expert_alignment=0), ValueError, r"expert_alignment: expected >= 1, got 0"),
        (dict(num_worst_tokens=-3), ValueError, r"num_worst_tokens: expected >= 0, got -3"),
        (dict(config="fast"), TypeError, r"config: expected an ep_dispatcher.Config or None, got str"),
        (dict(previous_event="now"), TypeError, r"previous_event: expected an EventOverlap or None, got str"),
        (
            dict(allocate_on_comm_stream=True),
            ValueError,
            r"allocate_on_comm_stream: needs previous_event and async_finish=True",
        ),
    ]
    for override, exc, pattern in bad:
        kwargs = dict(topk_idx=topk_idx, topk_weights=topk_weights, **layout)
        kwargs.update(override)
        with pytest.raises(exc, match=pattern):
            buf.dispatch(x, **kwargs)


def test_dispatch_names_x_and_topk_idx_when_their_rows_differ(group):
    """The layout comes from topk_idx: an x of another token count is reported as x vs topk_idx, not as a wrong
    is_token_in_rank shape (an argument the user did not build by hand)."""
    buf = _buffer()
    x, topk_idx, topk_weights = _routing(11)
    layout = _layout(buf, topk_idx)
    pattern = r"x, topk_idx: x has 4 rows \(tokens\) but topk_idx has 6; expected one topk_idx row per token of x"
    with pytest.raises(ValueError, match=pattern):
        buf.dispatch(x[:4].contiguous(), topk_idx=topk_idx, topk_weights=topk_weights, **layout)
    with pytest.raises(ValueError, match=pattern):  # the FP8 pair form counts the rows of its data
        buf.dispatch(per_token_cast_to_fp8(x[:4].contiguous()), topk_idx=topk_idx, topk_weights=topk_weights, **layout)


def test_reference_buffer_needs_no_nvl_bytes(group):
    # num_nvl_bytes sizes the CUDA engine's receive pool (which checks what each call needs, on every rank
    # alike: tests/gpu/test_intranode_gpu.py); the reference backend allocates none, so no size is enforced.
    x, topk_idx, topk_weights = _routing()
    buf = _buffer(num_nvl_bytes=0)
    recv_x, *_ = _dispatch(buf, x, topk_idx, topk_weights, config=Config())
    assert recv_x.size(0) > 0


def test_num_worst_tokens_too_small_is_reported(group):
    buf = _buffer()
    x, topk_idx, topk_weights = _routing()
    with pytest.raises(RuntimeError, match=r"num_worst_tokens: rank 0 received 6 tokens, more than num_worst_tokens=4"):
        _dispatch(buf, x, topk_idx, topk_weights, num_worst_tokens=4)


def test_handle_checks(group):
    buf, other = _buffer(), _buffer()
    x, topk_idx, topk_weights = _routing()
    recv_x, _, _, _, handle, _ = _dispatch(buf, x, topk_idx, topk_weights)
    with pytest.raises(ValueError, match=r"handle: it was created by another Buffer"):
        other.combine(recv_x, handle)
    with pytest.raises(ValueError, match=r"handle: it was created by another Buffer"):
        other.dispatch(x, handle=handle)
    with pytest.raises(TypeError, match=r"handle: expected a DispatchHandle returned by this Buffer, got tuple"):
        buf.combine(recv_x, (1, 2))
    with pytest.raises(ValueError, match=r"topk_idx: must be None in cached mode"):
        buf.dispatch(x, handle=handle, topk_idx=topk_idx)
    with pytest.raises(ValueError, match=r"x: the handle was made for 6 tokens, got 5"):
        buf.dispatch(x[:5].contiguous(), handle=handle)


def test_combine_rejects_bad_inputs(group):
    buf = _buffer()
    x, topk_idx, topk_weights = _routing()
    recv_x, _, recv_w, _, handle, _ = _dispatch(buf, x, topk_idx, topk_weights)
    rows = recv_x.size(0)
    cases = [
        (dict(x=recv_x[:-1].contiguous()), ValueError, rf"x: expected shape \[{rows}, \*\], got \[{rows - 1}, {H}\]"),
        (dict(x=recv_x.int()), TypeError, r"x: expected dtype"),
        (dict(topk_weights=recv_w.half()), TypeError, r"topk_weights: expected dtype torch.float32, got torch.float16"),
        (
            dict(bias=torch.zeros((N + 1, H), dtype=torch.bfloat16)),
            ValueError,
            rf"bias: expected shape \[{N}, {H}\], got \[{N + 1}, {H}\]",
        ),
        (dict(bias=torch.zeros((N, H))), TypeError, r"bias: expected dtype torch.bfloat16, got torch.float32"),
        (
            dict(bias=(torch.zeros((N, H), dtype=torch.bfloat16),) * 3),
            ValueError,
            r"bias: expected a tensor or a pair of tensors, got 3",
        ),
        (
            dict(bias=(torch.zeros((N, H), dtype=torch.bfloat16), torch.zeros((N, 1), dtype=torch.bfloat16))),
            ValueError,
            r"bias\[1\]: expected shape",
        ),
    ]
    for override, exc, pattern in cases:
        kwargs = dict(x=recv_x, handle=handle)
        kwargs.update(override)
        with pytest.raises(exc, match=pattern):
            buf.combine(**kwargs)


def test_destroyed_buffer_refuses_calls(group):
    buf = _buffer()
    _, topk_idx, _ = _routing()
    buf.destroy()
    with pytest.raises(RuntimeError, match="destroyed"):
        buf.get_dispatch_layout(topk_idx, E)
    with pytest.raises(RuntimeError, match="already destroyed"):
        buf.destroy()


# ---------------------------------------------------------------- low latency
def test_low_latency_rejects_bad_inputs(group):
    x, topk_idx, topk_weights = _routing()
    with pytest.raises(RuntimeError, match=r"low-latency calls need Buffer\(\.\.\., low_latency_mode=True"):
        _buffer(low_latency_mode=False).low_latency_dispatch(x, topk_idx, T, E)
    need = Buffer.get_low_latency_rdma_size_hint(T, H, 1, E)
    with pytest.raises(ValueError, match=rf"num_rdma_bytes: .*need at least {need} bytes"):
        _buffer(num_rdma_bytes=need // 2).low_latency_dispatch(x, topk_idx, T, E)
    buf = _buffer()
    cases = [
        (dict(x=x.float()), TypeError, r"x: expected dtype torch.bfloat16, got torch.float32"),
        (dict(x=x[:, :64].contiguous()), ValueError, r"x: low-latency kernels need hidden % 128 == 0, got hidden=64"),
        (
            dict(num_max_dispatch_tokens_per_rank=N - 1),
            ValueError,
            rf"x: {N} tokens exceed num_max_dispatch_tokens_per_rank={N - 1}",
        ),
        (dict(use_ue8m0=True), ValueError, r"use_ue8m0: needs round_scale=True"),
        (dict(use_ue8m0=True, round_scale=True), ValueError, r"use_ue8m0: needs hidden % 512 == 0 .*hidden=128"),
        (dict(topk_idx=topk_idx + 7), ValueError, r"topk_idx: expected entries in \[-1, 8\)"),
        (
            dict(topk_idx=torch.cat([topk_idx[:, :1], topk_idx[:, :1]], dim=1)),
            ValueError,
            r"topk_idx: token 0 lists an expert more than once",
        ),
        (
            dict(cumulative_local_expert_recv_stats=torch.zeros(E + 1, dtype=torch.int32)),
            ValueError,
            r"cumulative_local_expert_recv_stats: expected shape \[8\], got \[9\]",
        ),
        # [num_ranks] int64 as DeepEP's C++ checks (one rank here); a wrong dtype is a TypeError, as for every tensor.
        (
            dict(dispatch_wait_recv_cost_stats=torch.zeros(2, dtype=torch.int64)),
            ValueError,
            r"dispatch_wait_recv_cost_stats: expected shape \[1\], got \[2\]",
        ),
        (
            dict(dispatch_wait_recv_cost_stats=torch.zeros(1, dtype=torch.int32)),
            TypeError,
            r"dispatch_wait_recv_cost_stats: expected dtype torch.int64, got torch.int32",
        ),
        (
            dict(dispatch_wait_recv_cost_stats=torch.zeros(1, 1, dtype=torch.int64)),
            ValueError,
            r"dispatch_wait_recv_cost_stats: expected shape \[1\], got \[1, 1\]",
        ),
    ]
    for override, exc, pattern in cases:
        kwargs = dict(x=x, topk_idx=topk_idx, num_max_dispatch_tokens_per_rank=T, num_experts=E)
        kwargs.update(override)
        with pytest.raises(exc, match=pattern):
            buf.low_latency_dispatch(**kwargs)

    recv_x, _, handle, _, _ = buf.low_latency_dispatch(x, topk_idx, T, E, use_fp8=False)
    # zero_copy=True reads get_next_low_latency_combine_buffer(handle), not x (DeepEP's contract), but x's form is
    # still checked.
    with pytest.raises(ValueError, match=r"x: expected shape \[8, 16, 128\], got \[8, 16, 256\]"):
        buf.low_latency_combine(
            torch.zeros((E, T, 2 * H), dtype=torch.bfloat16), topk_idx, topk_weights, handle, zero_copy=True
        )
    with pytest.raises(ValueError, match=r"combine_wait_recv_cost_stats: expected shape \[1\], got \[2\]"):
        buf.low_latency_combine(
            recv_x, topk_idx, topk_weights, handle, combine_wait_recv_cost_stats=torch.zeros(2, dtype=torch.int64)
        )
    with pytest.raises(TypeError, match=r"combine_wait_recv_cost_stats: expected dtype torch.int64, got torch.float32"):
        buf.low_latency_combine(
            recv_x, topk_idx, topk_weights, handle, combine_wait_recv_cost_stats=torch.zeros(1, dtype=torch.float32)
        )
    # The reference backend adds 0 per rank (no per-peer wait to measure) and leaves the rest of the tensor alone.
    wait_stats = torch.full((1,), 5, dtype=torch.int64)
    buf.low_latency_combine(recv_x, topk_idx, topk_weights, handle, combine_wait_recv_cost_stats=wait_stats)
    _, _, handle, _, hook = buf.low_latency_dispatch(
        x, topk_idx, T, E, use_fp8=False, return_recv_hook=True, dispatch_wait_recv_cost_stats=wait_stats
    )
    hook()
    assert wait_stats.tolist() == [5]
    with pytest.raises(ValueError, match=r"topk_idx: expected shape \[6, 2\] \(as dispatched\), got \[6, 1\]"):
        buf.low_latency_combine(recv_x, topk_idx[:, :1].contiguous(), topk_weights, handle)
    with pytest.raises(ValueError, match=r"out: expected shape \[6, 128\], got \[5, 128\]"):
        buf.low_latency_combine(recv_x, topk_idx, topk_weights, handle, out=torch.empty((5, H), dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"x: expected shape \[8, 16, 128\], got \[8, 16, 256\]"):
        buf.low_latency_combine(torch.zeros((E, T, 2 * H), dtype=torch.bfloat16), topk_idx, topk_weights, handle)


def test_low_latency_hooks_are_bounded_and_single_use(group):
    buf = _buffer()
    x, topk_idx, topk_weights = _routing()
    _, _, _, _, hook_a = buf.low_latency_dispatch(x, topk_idx, T, E, return_recv_hook=True)
    _, _, _, _, hook_b = buf.low_latency_dispatch(x, topk_idx, T, E, return_recv_hook=True)
    assert buf.num_pending_low_latency_hooks == 2
    with pytest.raises(
        RuntimeError, match=r"buffer half 0 still holds an earlier call whose hook has not run \(2 pending\)"
    ):
        buf.low_latency_dispatch(x, topk_idx, T, E, return_recv_hook=True)
    hook_b()  # a newer hook may run first, but the oldest call still holds the half the next call needs
    with pytest.raises(
        RuntimeError, match=r"buffer half 0 still holds an earlier call .*\(1 pending\).*oldest pending hook"
    ):
        buf.low_latency_dispatch(x, topk_idx, T, E)
    hook_a()
    assert buf.num_pending_low_latency_hooks == 0
    with pytest.raises(RuntimeError, match="hook: already called"):
        hook_a()
    buf.low_latency_dispatch(x, topk_idx, T, E)  # room again


def test_low_latency_refuses_what_would_lose_a_pending_receive(group):
    buf = _buffer(num_rdma_bytes=Buffer.get_low_latency_rdma_size_hint(2 * T, H, 1, E))
    x, topk_idx, topk_weights = _routing()
    recv_x, _, handle, _, hook = buf.low_latency_dispatch(x, topk_idx, T, E, use_fp8=False, return_recv_hook=True)
    with pytest.raises(RuntimeError, match=r"handle: the receive hook of the low_latency_dispatch .* has not run"):
        buf.low_latency_combine(recv_x, topk_idx, topk_weights, handle)
    with pytest.raises(RuntimeError, match=r"differs from the previous call's \(16, 128, 8\) while 1 hook\(s\)"):
        buf.low_latency_dispatch(x, topk_idx, 2 * T, E)
    with pytest.raises(RuntimeError, match=r"clean_low_latency_buffer: 1 low-latency hook\(s\) have not run"):
        buf.clean_low_latency_buffer(T, H, E)
    hook()
    buf.low_latency_combine(recv_x, topk_idx, topk_weights, handle)  # fine once received
    buf.low_latency_dispatch(x, topk_idx, 2 * T, E)  # and a new shape once nothing is pending
    buf.clean_low_latency_buffer(T, H, E)


def test_low_latency_hook_matches_one_shot(group):
    buf = _buffer()
    x, topk_idx, topk_weights = _routing(3)
    (a, sa), count_a, ha, _, _ = buf.low_latency_dispatch(x, topk_idx, T, E)
    (b, sb), count_b, hb, _, hook = buf.low_latency_dispatch(x, topk_idx, T, E, return_recv_hook=True)
    hook()
    assert torch.equal(count_a, count_b) and torch.equal(ha.src_info, hb.src_info)
    assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)) and torch.equal(sa, sb)
    y = torch.randn(a.shape).to(torch.bfloat16)
    out_a, _, _ = buf.low_latency_combine(y, topk_idx, topk_weights, ha)
    out_b, _, hook = buf.low_latency_combine(y, topk_idx, topk_weights, hb, return_recv_hook=True)
    hook()
    assert torch.equal(out_a, out_b)


def test_low_latency_device_reported_topk_errors(group):
    """The CUDA engine checks topk_idx in its kernels (no host sync) and leaves a record in host-mapped memory; Buffer
    raises ValueError after the call's launches (running the call's own receive first, so peers never wait) or from a
    hook. Simulated here on the reference backend with a backend that claims device checks."""
    buf = _buffer()
    x, topk_idx, topk_weights = _routing(5)
    reports = []
    buf._backend.low_latency_checks_on_device = lambda device: True
    buf._backend.take_low_latency_error = lambda: reports.pop() if reports else None

    reports.append((1, 3, 1, 300))
    pattern = r"topk_idx: expected entries in \[-1, 8\) \(-1 = no expert\), got 300 \(token 3, k 1\)"
    with pytest.raises(ValueError, match=pattern):
        buf.low_latency_dispatch(x, topk_idx, T, E, return_recv_hook=True)
    assert buf.num_pending_low_latency_hooks == 0, "the raising call ran its own receive phase first"

    recv_x, _, handle, _, hook = buf.low_latency_dispatch(x, topk_idx, T, E, use_fp8=False, return_recv_hook=True)
    reports.append((2, 0, 1, 5))
    with pytest.raises(ValueError, match=r"topk_idx: token 0 lists an expert more than once \(expert 5 again at k 1\)"):
        hook()
    assert buf.num_pending_low_latency_hooks == 0  # and the handle counts as received: the combine below takes it

    reports.append((3, 2, 0, -7))
    pattern = r"got -7 \(token 2, k 0\); found on the GPU by the low-latency combine kernel"
    with pytest.raises(ValueError, match=pattern):
        buf.low_latency_combine(recv_x, topk_idx, topk_weights, handle, return_recv_hook=True)
    assert buf.num_pending_low_latency_hooks == 0
    out, _, _ = buf.low_latency_combine(recv_x, topk_idx, topk_weights, handle)  # the next call works
    assert out.shape == (N, H)


def test_low_latency_topk_error_messages():
    from ep_dispatcher.validation import low_latency_topk_error

    huge = low_latency_topk_error(1, 4, 0, 2**31 - 1, 256)
    assert isinstance(huge, ValueError)
    assert "got 2147483647 or beyond (token 4, k 0)" in str(huge) and "low-latency dispatch kernel" in str(huge)
    assert "[-1, 256)" in str(low_latency_topk_error(3, 0, 2, -2, 256))


# ---------------------------------------------------------------- helpers
def test_config_validation_and_hints():
    assert Config(num_sms=7).num_sms == 7  # no channel pairs: any positive SM count
    with pytest.raises(ValueError, match=r"Config.num_sms: expected a positive int"):
        Config(num_sms=0)
    with pytest.raises(
        ValueError, match=r"Config.num_max_nvl_chunked_send_tokens: expected <= num_max_nvl_chunked_recv_tokens"
    ):
        Config(20, 300, 256)
    with pytest.raises(ValueError, match=r"hidden_bytes: expected a positive multiple of 16"):
        Config().get_nvl_buffer_size_hint(100, 8)
    small, large = Config().get_nvl_buffer_size_hint(7168 * 2, 8), Config().get_nvl_buffer_size_hint(7168 * 2, 2)
    assert small > large > 0, "more peers need more ring buffers"
    assert Config().get_rdma_buffer_size_hint(7168 * 2, 8) == 0
    assert Config().get_rdma_buffer_size_hint(7168 * 2, 16) > 0
    assert Buffer.get_low_latency_rdma_size_hint(128, 7168, 8, 256) > Buffer.get_low_latency_rdma_size_hint(
        64, 7168, 8, 256
    )
    with pytest.raises(ValueError, match=r"hidden: low-latency kernels need hidden % 128 == 0"):
        Buffer.get_low_latency_rdma_size_hint(128, 100, 8, 256)


def test_tuned_configs_load_and_set_num_sms():
    old = Buffer.num_sms
    try:
        Buffer.set_num_sms(24)
        cfg = Buffer.get_dispatch_config(8)
        assert cfg.num_sms == 24 and cfg.num_max_nvl_chunked_recv_tokens == 256
        assert Buffer.get_combine_config(8).num_max_nvl_chunked_send_tokens == 4  # from configs/default.json
        assert Buffer.get_dispatch_config(3) == Buffer.get_dispatch_config(4)  # next tuned rank count up
        Buffer.set_num_sms(5)  # odd counts are fine: no sender/receiver channel pairs
        assert Buffer.get_dispatch_config(8).num_sms == 5
        with pytest.raises(ValueError, match=r"new_num_sms"):
            Buffer.set_num_sms(0)
    finally:
        Buffer.set_num_sms(old)


def test_event_overlap_on_cpu():
    event = Buffer.capture() if not torch.cuda.is_available() else EventOverlap()
    with event as e:
        assert e is event
    event.current_stream_wait()


def test_fp8_cast_rules():
    g = torch.Generator().manual_seed(5)
    x = (torch.randn((9, 512), generator=g) * 10).to(torch.bfloat16)
    x[0, :128] = 0  # all-zero group: amax floor keeps the scale finite
    q, s = per_token_cast_to_fp8(x)
    xf = x.double().view(9, 4, 128)
    amax = xf.abs().amax(-1).clamp(min=1e-4)
    assert torch.equal(s, (amax.float() / 448.0))
    back = q.double().view(9, 4, 128) * s.double().unsqueeze(-1)
    # e4m3 keeps 3 mantissa bits: relative error <= 2**-4, plus the subnormal step near zero.
    assert bool(((back - xf).abs() <= xf.abs() * 2**-4 + s.double().unsqueeze(-1) * 2**-9).all())
    q2, s2 = per_token_cast_to_fp8(x, round_scale=True)
    assert bool((torch.log2(s2) == torch.log2(s2).round()).all()) and bool((s2 >= s).all()) and bool((s2 < 2 * s).all())
    q3, packed = per_token_cast_to_fp8(x, round_scale=True, use_ue8m0=True)
    assert packed.dtype == torch.int32 and packed.shape == (9, 1)
    assert torch.equal(q3.view(torch.uint8), q2.view(torch.uint8))
    from ep_dispatcher.fp8 import unpack_ue8m0

    assert torch.equal(unpack_ue8m0(packed), s2)
