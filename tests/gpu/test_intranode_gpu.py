"""Intranode CUDA engine vs the reference backend, bit for bit, with N ranks sharing the GPU(s).

Run under MPS when several ranks share one GPU (tests/gpu/run_device.sh does that): without MPS the ranks'
kernels time-slice and every barrier costs milliseconds.
"""

from __future__ import annotations

import hashlib
import os

import pytest
import torch

from tests import reference_cases as rc
from tests.dist import run
from tests.gpu.common import NUM_SMS, WORLDS, WORLDS_AND_ONE, require_extension, set_device
from tests.poison import poison_allocator

pytestmark = pytest.mark.gpu
require_extension()

from ep_dispatcher import Buffer, Config, per_token_cast_to_fp8  # noqa: E402

NUM_NVL_BYTES = 1 << 30  # >= Config.get_nvl_buffer_size_hint(7168 * 4, 8) (fp32 combine), which the Buffer checks


def _buffers(world: int):
    cuda = Buffer(None, num_nvl_bytes=NUM_NVL_BYTES, backend="cuda", timeout_s=60)
    ref = Buffer(None, num_nvl_bytes=NUM_NVL_BYTES, backend="reference")
    assert "dispatch" in cuda.engine_calls
    cuda._backend.ipc.poison_receive_pool(True)  # outputs live in the receive pool: poison it, not only the allocator
    return cuda, ref


def _compare_case(cuda: Buffer, ref: Buffer, case: rc.Case, me: int, device) -> None:
    inputs = [rc.rank_inputs(case, r) for r in range(case.num_ranks)]
    x, topk_idx, topk_weights = (t.to(device) for t in inputs[me])
    config = Config(NUM_SMS)
    poison_allocator(64 << 20, device)

    layout_c = cuda.get_dispatch_layout(topk_idx, case.num_experts)
    layout_r = ref.get_dispatch_layout(topk_idx, case.num_experts)
    for a, b in zip(layout_c[:4], layout_r[:4]):
        assert (a is None and b is None) or torch.equal(a, b)
    # The call above took Buffer's hot path (straight to the kernel); async_finish takes the general path (checks,
    # communication stream, event): the same outputs.
    layout_g = cuda.get_dispatch_layout(topk_idx, case.num_experts, async_finish=True)
    layout_g[4].current_stream_wait()
    for a, b in zip(layout_g[:4], layout_r[:4]):
        assert (a is None and b is None) or torch.equal(a, b)
    per_rank, _, per_expert, in_rank, _ = layout_c
    alignment = 1 + case.seed % 3
    kwargs = dict(
        num_tokens_per_rank=per_rank,
        is_token_in_rank=in_rank,
        num_tokens_per_expert=per_expert,
        topk_idx=topk_idx,
        topk_weights=topk_weights,
        expert_alignment=alignment,
        config=config,
    )
    out_c = cuda.dispatch(x, **kwargs)
    out_r = ref.dispatch(x, **kwargs)
    for name, a, b in zip(("recv_x", "recv_topk_idx", "recv_topk_weights"), out_c[:3], out_r[:3]):
        assert torch.equal(a, b), name
    assert out_c[3] == out_r[3], "num_recv_tokens_per_expert_list"
    hc, hr = out_c[4], out_r[4]
    assert torch.equal(hc.rank_prefix_matrix, hr.rank_prefix_matrix)
    assert torch.equal(hc.recv_src_idx, hr.recv_src_idx)
    assert torch.equal(hc.num_recv_tokens_per_expert, hr.num_recv_tokens_per_expert)
    assert hc.num_recv_tokens == hr.num_recv_tokens

    # Combine: bias pair and weights, bit-exact (same fp32 order).
    g = torch.Generator().manual_seed(case.seed + 5)
    biases = tuple(torch.randn((x.size(0), case.hidden), generator=g).to(torch.bfloat16).to(device) for _ in range(2))
    y = rc.expert_fn(me, out_c[0])
    comb_c = cuda.combine(y, hc, topk_weights=out_c[2], bias=biases, config=config)
    comb_r = ref.combine(y, hr, topk_weights=out_r[2], bias=biases)
    assert torch.equal(comb_c[0], comb_r[0]), "combined_x"
    assert torch.equal(comb_c[1], comb_r[1]), "combined_topk_weights"
    comb_c = cuda.combine(y, hc, config=config)
    assert torch.equal(comb_c[0], ref.combine(y, hr)[0]), "combined_x without bias"
    # Inputs that lie in the receive pool (recv_x itself, and its weights) are pulled by the sources; here even ranks
    # pull and odd ranks push (a copy lies outside the pool), in one call.
    pulled_x = out_c[0] if me % 2 == 0 else out_c[0].clone()
    pulled_w = out_c[2] if me % 2 == 0 else out_c[2].clone()
    comb_c = cuda.combine(pulled_x, hc, topk_weights=pulled_w, bias=biases, config=config)
    comb_r = ref.combine(out_r[0], hr, topk_weights=out_r[2], bias=biases)
    assert torch.equal(comb_c[0], comb_r[0]) and torch.equal(comb_c[1], comb_r[1]), "pulled / pushed combine"

    # Cached dispatch reproduces the layout for other data; fp32 combine too.
    x2 = (x.float() * 3 - 1).to(torch.bfloat16)
    assert torch.equal(cuda.dispatch(x2, handle=hc, config=config)[0], ref.dispatch(x2, handle=hr)[0])
    y32 = out_c[0].float() * 0.5
    assert torch.equal(cuda.combine(y32, hc, config=config)[0], ref.combine(y32, hr)[0]), "fp32 combine"

    # FP8 payloads.
    if case.hidden % 128 == 0:
        x8 = per_token_cast_to_fp8(x)
        (d_c, s_c), *_ = cuda.dispatch(x8, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, config=config)
        (d_r, s_r), *_ = ref.dispatch(x8, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank)
        assert torch.equal(d_c.view(torch.uint8), d_r.view(torch.uint8)) and torch.equal(s_c, s_r), "fp8"

    # num_worst_tokens: no host sync; valid rows equal, padding rows marked.
    worst = sum(case.tokens_per_rank) + 5
    wc = cuda.dispatch(x, num_worst_tokens=worst, **kwargs)
    n = hr.num_recv_tokens
    assert wc[0].size(0) == worst and wc[3] == [] and wc[4].num_recv_tokens == -1
    assert torch.equal(wc[0][:n], out_r[0]) and torch.equal(wc[1][:n], out_r[1]) and torch.equal(wc[2][:n], out_r[2])
    assert bool((wc[1][n:] == -1).all()) and bool((wc[2][n:] == 0).all()) and bool((wc[4].recv_src_idx[n:] == -1).all())
    yw = rc.expert_fn(me, wc[0])
    expected = ref.combine(rc.expert_fn(me, out_r[0]), hr, bias=biases)[0]
    assert torch.equal(cuda.combine(yw, wc[4], bias=biases, config=config)[0], expected), "worst-mode combine"


def _compare_worker(rank: int, world: int, seeds) -> int:
    device = set_device(rank)
    cuda, ref = _buffers(world)
    for seed in seeds:
        case = rc.random_case(seed, world, hidden_choices=(2048, 4096, 7168, 1024 + 8))
        try:
            _compare_case(cuda, ref, case, rank, device)
        except AssertionError as e:
            raise AssertionError(f"rank {rank} {case}: {e}") from e
    torch.cuda.synchronize()
    cuda.destroy()
    return len(seeds)


@pytest.mark.parametrize("world", WORLDS_AND_ONE)
def test_intranode_matches_reference(world: int) -> None:
    seeds = [9000 + world * 10 + i for i in range(4)]
    assert run(_compare_worker, world, seeds) == [len(seeds)] * world


def _graph_and_stress_worker(rank: int, world: int, iterations: int) -> str:
    """CUDA-graph replay of a worst-case dispatch + combine with new inputs, as a stress loop of changing routings."""
    device = set_device(rank)
    cuda, _ = _buffers(world)
    config = Config(NUM_SMS)
    num_tokens, hidden, num_experts, topk = 256, 2048, 8 * world, 4
    worst = num_tokens * world
    x = torch.empty((num_tokens, hidden), dtype=torch.bfloat16, device=device)
    topk_idx = torch.empty((num_tokens, topk), dtype=torch.int64, device=device)
    topk_weights = torch.empty((num_tokens, topk), dtype=torch.float32, device=device)

    def fill(seed: int):
        g = torch.Generator(device="cpu").manual_seed(seed * 100 + rank)
        x.copy_(torch.randn((num_tokens, hidden), generator=g).to(torch.bfloat16))
        topk_idx.copy_(torch.rand((num_tokens, num_experts), generator=g).argsort(1)[:, :topk])
        topk_idx.masked_fill_(torch.rand((num_tokens, topk), generator=g).to(device) < 0.1, -1)
        topk_weights.copy_(torch.rand((num_tokens, topk), generator=g))

    def step():
        per_rank, _, per_expert, in_rank, _ = cuda.get_dispatch_layout(topk_idx, num_experts)
        recv_x, _, recv_w, _, handle, _ = cuda.dispatch(
            x,
            num_tokens_per_rank=per_rank,
            is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert,
            topk_idx=topk_idx,
            topk_weights=topk_weights,
            num_worst_tokens=worst,
            config=config,
        )
        out, _, _ = cuda.combine(recv_x, handle, config=config)
        return out, in_rank

    fill(0)
    cuda.validate_inputs = False  # no host reads inside the graph
    step()  # warm-up outside capture (allocations, comm stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_g, in_rank_g = step()
    digest = hashlib.sha256()
    for it in range(iterations):
        fill(it + 1)
        graph.replay()
        torch.cuda.synchronize()
        # combine(dispatch(x)) with identity experts = x times the number of ranks the token went to (exact in bf16).
        expected = (x.float() * in_rank_g.sum(1, keepdim=True).float()).to(torch.bfloat16)
        if not torch.equal(out_g, expected):
            raise AssertionError(f"rank {rank}: graph replay {it} differs from the expected sum")
        eager, _ = step()
        if not torch.equal(eager, out_g):
            raise AssertionError(f"rank {rank}: eager step {it} differs from the graph replay")
        digest.update(out_g.view(torch.uint8).cpu().numpy().tobytes())
    cuda.destroy()
    return digest.hexdigest()


@pytest.mark.parametrize("world", WORLDS_AND_ONE)
def test_intranode_graph_replay_and_stress(world: int) -> None:
    iterations = int(os.environ.get("EP_GPU_STRESS_ITERATIONS", "50"))
    first = run(_graph_and_stress_worker, world, iterations)
    second = run(_graph_and_stress_worker, world, iterations)
    assert first == second, "same inputs, different results across runs: a race"


def _input_error_worker(rank: int, world: int) -> list:
    """Bad contents found on the device (no host sync) raise ValueError on every rank at the count exchange, and the
    buffer keeps working afterwards."""
    device = set_device(rank)
    cuda, ref = _buffers(world)
    config = Config(NUM_SMS)
    num_tokens, hidden, num_experts, topk = 64, 256, 4 * world, 2
    g = torch.Generator().manual_seed(40 + rank)
    x = torch.randn((num_tokens, hidden), generator=g).to(torch.bfloat16).to(device)
    topk_idx = torch.rand((num_tokens, num_experts), generator=g).argsort(1)[:, :topk].to(device)
    topk_weights = torch.rand((num_tokens, topk), generator=g).to(device)
    per_rank, _, per_expert, in_rank, _ = cuda.get_dispatch_layout(topk_idx, num_experts)
    kwargs = dict(is_token_in_rank=in_rank, num_tokens_per_expert=per_expert, topk_weights=topk_weights, config=config)
    messages = []

    bad_idx = topk_idx.clone()
    if rank == world - 1:
        bad_idx[5, 1] = num_experts + 7  # only the last rank's input is bad: every rank must raise, none may hang
    try:
        cuda.dispatch(x, num_tokens_per_rank=per_rank, topk_idx=bad_idx, **kwargs)
        messages.append("no error")
    except ValueError as e:
        messages.append(str(e))

    # topk_idx 8 bytes past a 16-byte boundary (the range check reads 16-byte vectors: a leading entry and a tail
    # read alone), bad in its first entry, then in its last.
    for token, column, value in ((0, 0, -2), (num_tokens - 1, topk - 1, num_experts)):
        skewed = torch.empty(topk_idx.numel() + 2, dtype=torch.int64, device=device)[1:-1].view(topk_idx.shape)
        assert skewed.data_ptr() % 16 == 8
        skewed.copy_(topk_idx)
        if rank == 0:
            skewed[token, column] = value
        try:
            cuda.dispatch(x, num_tokens_per_rank=per_rank, topk_idx=skewed, **kwargs)
            messages.append("no error")
        except ValueError as e:
            messages.append(str(e))

    bad_counts = per_rank.clone()
    if rank == 0:
        bad_counts[world - 1] += 3
    try:
        cuda.dispatch(x, num_tokens_per_rank=bad_counts, topk_idx=topk_idx, **kwargs)
        messages.append("no error")
    except ValueError as e:
        messages.append(str(e))

    # Rows of another width on one rank would overrun the blocks laid out for the others: every rank refuses.
    x_wide = torch.randn((num_tokens, hidden + (64 if rank == 0 else 0)), generator=g).to(torch.bfloat16).to(device)
    try:
        cuda.dispatch(x_wide, num_tokens_per_rank=per_rank, topk_idx=topk_idx, **kwargs)
        messages.append("no error")
    except ValueError as e:
        messages.append(str(e))

    # The buffer still works, bit-exact.
    out_c = cuda.dispatch(x, num_tokens_per_rank=per_rank, topk_idx=topk_idx, **kwargs)
    out_r = ref.dispatch(x, num_tokens_per_rank=per_rank, topk_idx=topk_idx, **kwargs)
    assert torch.equal(out_c[0], out_r[0]) and torch.equal(out_c[1], out_r[1])
    torch.cuda.synchronize()
    cuda.destroy()
    return messages


@pytest.mark.parametrize("world", [w for w in WORLDS if w in (2, 4)])
def test_intranode_bad_contents_raise_on_every_rank(world: int) -> None:
    for rank, messages in enumerate(run(_input_error_worker, world)):
        range_error, first_error, last_error, count_error, shape_error = messages
        assert "topk_idx: expected entries in [-1, " in range_error, (rank, range_error)
        assert f"got {4 * world + 7} at token 5, column 1" in range_error, (rank, range_error)
        assert "got -2 at token 0, column 0" in first_error, (rank, first_error)
        assert f"got {4 * world} at token 63, column 1" in last_error, (rank, last_error)
        assert (rank == world - 1) == ("on rank" not in range_error), (rank, range_error)
        assert "num_tokens_per_rank: entry" in count_error, (rank, count_error)
        assert "is_token_in_rank sends" in count_error, (rank, count_error)
        assert "x: row bytes (hidden x element size) must be the same on every rank" in shape_error, (rank, shape_error)


def _lifetime_worker(rank: int, world: int) -> int:
    """Outputs own their receive-pool regions: they survive any number of later calls (the pool evicts the oldest
    ones when it runs out of room) and the buffer's destruction, bit for bit."""
    device = set_device(rank)
    config = Config(NUM_SMS)
    num_tokens, hidden, num_experts, topk = 128, 1024, 4 * world, 2
    row_bytes = hidden * 2 + topk * 12 + 4
    # Room for about two dispatches' outputs at most, so that keeping them alive forces evictions.
    pool_bytes = int(2.5 * num_tokens * world * row_bytes) + (1 << 16)
    cuda = Buffer(None, num_nvl_bytes=pool_bytes, backend="cuda", timeout_s=60)
    cuda._backend.ipc.poison_receive_pool(True)
    kept = []
    for it in range(6):
        g = torch.Generator().manual_seed(700 + 10 * it + rank)
        x = torch.randn((num_tokens, hidden), generator=g).to(torch.bfloat16).to(device)
        topk_idx = torch.rand((num_tokens, num_experts), generator=g).argsort(1)[:, :topk].to(device)
        topk_weights = torch.rand((num_tokens, topk), generator=g).to(device)
        per_rank, _, per_expert, in_rank, _ = cuda.get_dispatch_layout(topk_idx, num_experts)
        recv_x, recv_idx, recv_w, _, handle, _ = cuda.dispatch(
            x,
            num_tokens_per_rank=per_rank,
            is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert,
            topk_idx=topk_idx,
            topk_weights=topk_weights,
            config=config,
        )
        cached, *_ = cuda.dispatch(x, handle=handle, config=config)  # a second output of the same shape
        combined, _, _ = cuda.combine(recv_x, handle, config=config)
        expected = (x.float() * in_rank.sum(1, keepdim=True).float()).to(torch.bfloat16)
        assert torch.equal(combined, expected), f"iteration {it}: combine of the received rows"
        assert torch.equal(cached, recv_x), f"iteration {it}: cached dispatch"
        kept.append((recv_x, recv_idx, recv_w, recv_x.clone(), recv_idx.clone(), recv_w.clone()))
        for j, (a, b, c, a0, b0, c0) in enumerate(kept):
            same = torch.equal(a, a0) and torch.equal(b, b0) and torch.equal(c, c0)
            assert same, f"output {j} changed at iteration {it}"
    # A call that does not fit even in the empty pool grows every rank's pool (all see the same counts) and runs;
    # the outputs kept so far move out of the old pool, unchanged.
    big_idx = torch.randint(0, num_experts, (20 * num_tokens, 1), device=device)
    big_x = torch.randn((20 * num_tokens, hidden), device=device).to(torch.bfloat16)
    per_rank, _, _, in_rank, _ = cuda.get_dispatch_layout(big_idx, num_experts)
    big_recv, _, _, _, big_handle, _ = cuda.dispatch(
        big_x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, config=config
    )
    assert cuda._backend.ipc.data_bytes > pool_bytes, "the receive pool grew"
    big_out, _, _ = cuda.combine(big_recv, big_handle, config=config)
    assert torch.equal(big_out, (big_x.float() * in_rank.sum(1, keepdim=True).float()).to(torch.bfloat16)), "grown pool"
    for j, (a, b, c, a0, b0, c0) in enumerate(kept):
        assert torch.equal(a, a0) and torch.equal(b, b0) and torch.equal(c, c0), f"output {j} changed by the growth"
    torch.cuda.synchronize()
    cuda.destroy()
    for j, (a, b, c, a0, b0, c0) in enumerate(kept):
        assert torch.equal(a, a0) and torch.equal(b, b0) and torch.equal(c, c0), f"output {j} changed by destroy()"
    return len(kept)


@pytest.mark.parametrize("world", [w for w in WORLDS if w in (2, 4)])
def test_intranode_outputs_outlive_later_calls_and_the_buffer(world: int) -> None:
    assert run(_lifetime_worker, world) == [6] * world


def _rerun_worker(rank: int, world: int) -> int:
    """A fresh dispatch that does not fit in the largest free region while earlier outputs fill the pool: the block
    laid out before the counts were known is too small, so the data phase runs again after evicting the oldest
    outputs. Exact, and the outputs kept alive are unchanged."""
    device = set_device(rank)
    config = Config(NUM_SMS)
    hidden, n = 512, 64

    # Token t goes to rank t % world only (no top-k): every rank receives exactly num_tokens rows, in source order.
    # Twice one big call's outputs and 10 % (a smaller pool would grow instead: see the end of this test), so that the
    # big and the small call's outputs leave less than one big call's room free. Block sizes: x and src regions, each
    # 128-byte aligned.
    def block(rows: int) -> int:
        return -(-rows * hidden * 2 // 128) * 128 + -(-rows * 4 // 128) * 128

    pool_bytes = 2 * block(4 * n) + block(4 * n) // 10
    assert block(4 * n) + block(n) + block(4 * n) > pool_bytes >= 2 * block(4 * n)
    cuda = Buffer(None, num_nvl_bytes=pool_bytes, backend="cuda", timeout_s=60)
    cuda._backend.ipc.poison_receive_pool(True)

    def inputs(num_tokens: int, seed: int, source: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed + source)
        return torch.randn((num_tokens, hidden), generator=g).to(torch.bfloat16).to(device)

    def call(num_tokens: int, seed: int):
        x = inputs(num_tokens, seed, rank)
        in_rank = torch.nn.functional.one_hot(torch.arange(num_tokens) % world, world).bool().to(device)
        recv_x, _, _, _, handle, _ = cuda.dispatch(
            x, num_tokens_per_rank=in_rank.sum(0).int(), is_token_in_rank=in_rank, config=config
        )
        expected = torch.cat([inputs(num_tokens, seed, s)[rank::world] for s in range(world)])
        assert torch.equal(recv_x, expected), f"{num_tokens} tokens: received rows"
        return x, recv_x, handle, expected

    _, big, _, big_expected = call(4 * n, 900)  # about half the pool
    _, small, _, small_expected = call(n, 910)  # after it
    before = cuda._backend.ipc.dispatch_reruns
    x2, big2, handle2, big2_expected = call(4 * n, 920)  # the free region left is too small: it runs again
    reruns = cuda._backend.ipc.dispatch_reruns - before
    assert cuda._backend.ipc.data_bytes == pool_bytes, "the pool holds two such calls: it must not grow"
    combined, _, _ = cuda.combine(big2, handle2, config=config)
    assert torch.equal(combined, x2), "combine of the rerun call's rows"
    # A call that needs more than half the pool while earlier outputs hold it: the pool grows (twice the call) instead
    # of evicting on every call of a loop that keeps its last outputs alive.
    del combined, handle2
    x3, huge, _, huge_expected = call(6 * n, 930)
    assert cuda._backend.ipc.data_bytes > pool_bytes, "a pool below twice the call's outputs grows"
    for name, a, a0 in (
        ("big", big, big_expected),
        ("small", small, small_expected),
        ("big2", big2, big2_expected),
        ("huge", huge, huge_expected),
    ):
        assert torch.equal(a, a0), f"{name} changed"
    torch.cuda.synchronize()
    cuda.destroy()
    return reruns


@pytest.mark.parametrize("world", [w for w in WORLDS if w in (2, 4)])
def test_intranode_fresh_dispatch_reruns_when_the_laid_out_block_is_too_small(world: int) -> None:
    assert run(_rerun_worker, world) == [1] * world


def _fallback_worker(rank: int, world: int) -> int:
    """Combine in fp16 and fp64 (the kernels sum bf16 and fp32 only): the cuda backend routes it to the reference
    backend it holds, on the engine's handle; the results equal a reference buffer's, bit for bit."""
    device = set_device(rank)
    cuda, ref = _buffers(world)
    config = Config(NUM_SMS)
    num_tokens, hidden, num_experts, topk = 96, 512, 4 * world, 2
    g = torch.Generator().manual_seed(1700 + rank)
    x = torch.randn((num_tokens, hidden), generator=g).to(torch.bfloat16).to(device)
    topk_idx = torch.rand((num_tokens, num_experts), generator=g).argsort(1)[:, :topk].to(device)
    topk_weights = torch.rand((num_tokens, topk), generator=g).to(device)
    per_rank, _, per_expert, in_rank, _ = ref.get_dispatch_layout(topk_idx, num_experts)
    kwargs = dict(
        num_tokens_per_rank=per_rank,
        is_token_in_rank=in_rank,
        num_tokens_per_expert=per_expert,
        topk_idx=topk_idx,
        topk_weights=topk_weights,
    )
    out_c = cuda.dispatch(x, config=config, **kwargs)
    out_r = ref.dispatch(x, **kwargs)
    assert torch.equal(out_c[0], out_r[0])
    checked = 0
    for dtype in (torch.float16, torch.float64):
        y = (out_c[0].float() * 0.75 - 0.5).to(dtype)
        bias = torch.randn((num_tokens, hidden), generator=g).to(dtype).to(device)
        comb_c = cuda.combine(y, out_c[4], topk_weights=out_c[2], bias=bias, config=config)
        comb_r = ref.combine(y, out_r[4], topk_weights=out_r[2], bias=bias)
        assert comb_c[0].dtype == dtype, str(dtype)
        assert torch.equal(comb_c[0], comb_r[0]) and torch.equal(comb_c[1], comb_r[1]), f"{dtype} combine"
        checked += 1
    # The engine's handle still serves the engine afterwards (the fallback made a new handle, left this one as is).
    y = out_c[0]
    assert torch.equal(cuda.combine(y, out_c[4], config=config)[0], ref.combine(out_r[0], out_r[4])[0]), "bf16 after"
    torch.cuda.synchronize()
    cuda.destroy()
    return checked


@pytest.mark.parametrize("world", [w for w in WORLDS if w in (2, 4)])
def test_intranode_fp16_fp64_combine_falls_back_to_the_reference(world: int) -> None:
    assert run(_fallback_worker, world) == [2] * world


def _long_scan_worker(rank: int, world: int) -> int:
    """Inputs longer than one scan chunk (send positions are scanned in chunks of 4096 tokens side by side, each chunk
    starting from the hits of the chunks before it): a different token count per rank, dropped entries, and an
    is_token_in_rank that starts at an odd address (the chunk counts then read it byte by byte). Bit-exact against
    the reference, fresh and from the handle; a wrong count would also raise (it is checked against
    num_tokens_per_rank)."""
    device = set_device(rank)
    cuda, ref = _buffers(world)
    config = Config(NUM_SMS)
    num_tokens, hidden, num_experts, topk = 2 * 4096 + 1000 + 37 * rank, 256, 4 * world, 2
    g = torch.Generator().manual_seed(1900 + rank)
    x = torch.randn((num_tokens, hidden), generator=g).to(torch.bfloat16).to(device)
    topk_idx = torch.rand((num_tokens, num_experts), generator=g).argsort(1)[:, :topk]
    topk_idx.masked_fill_(torch.rand((num_tokens, topk), generator=g) < 0.3, -1)
    topk_idx = topk_idx.to(device)
    topk_weights = torch.rand((num_tokens, topk), generator=g).to(device)
    per_rank, _, per_expert, in_rank, _ = ref.get_dispatch_layout(topk_idx, num_experts)
    odd = torch.zeros(in_rank.numel() + 1, dtype=torch.bool, device=device)[1:].view(in_rank.shape)
    odd.copy_(in_rank)
    assert odd.data_ptr() % 16 != 0
    x2 = (x.float() * 2 + 1).to(torch.bfloat16)
    checked = 0
    for matrix in (in_rank, odd):
        kwargs = dict(num_tokens_per_rank=per_rank, is_token_in_rank=matrix, num_tokens_per_expert=per_expert)
        kwargs.update(topk_idx=topk_idx, topk_weights=topk_weights)
        out_c = cuda.dispatch(x, config=config, **kwargs)
        out_r = ref.dispatch(x, **kwargs)
        for name, a, b in zip(("recv_x", "recv_topk_idx", "recv_topk_weights"), out_c[:3], out_r[:3]):
            assert torch.equal(a, b), name
        hc, hr = out_c[4], out_r[4]
        assert torch.equal(hc.rank_prefix_matrix, hr.rank_prefix_matrix), "rank_prefix_matrix"
        assert torch.equal(hc.recv_src_idx, hr.recv_src_idx), "recv_src_idx"
        assert torch.equal(cuda.dispatch(x2, handle=hc, config=config)[0], ref.dispatch(x2, handle=hr)[0]), "cached"
        assert torch.equal(cuda.combine(out_c[0], hc, config=config)[0], ref.combine(out_r[0], hr)[0]), "combine"
        checked += 1
    torch.cuda.synchronize()
    cuda.destroy()
    return checked


@pytest.mark.parametrize("world", WORLDS_AND_ONE)
def test_intranode_send_positions_over_several_scan_chunks(world: int) -> None:
    assert run(_long_scan_worker, world) == [2] * world
