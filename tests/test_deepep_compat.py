"""Issue 20: programs written for DeepEP v1.2.1 run unchanged. Each test calls ep_dispatcher the way DeepEP's own tests
and clients call ``deep_ep`` (``import deep_ep`` after ``install_as_deep_ep()``, keyword dicts, ``handle[0]``,
unpacking, ``EventOverlap(EventHandle())``), on the reference backend over gloo with 2 and 4 ranks.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import warnings

import pytest
import torch
import torch.distributed as dist

from ep_dispatcher import per_token_cast_back, per_token_cast_to_fp8
from ep_dispatcher.launch import free_port
from ep_dispatcher.logfmt import LOGFMT_GROUP_SIZE, logfmt_roundtrip
from tests.dist import run


def _deep_ep():
    import ep_dispatcher

    return ep_dispatcher.install_as_deep_ep()


def calc_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    """1 - cosine-like similarity of ``x + 1`` and ``y + 1`` (the metric DeepEP's tests bound)."""
    x, y = x.double() + 1, y.double() + 1
    return float(1 - 2 * (x * y).sum() / (x * x + y * y).sum())


def _routing(rank: int, num_tokens: int, num_experts: int, num_topk: int, num_ranks: int, seed: int = 0):
    """DeepEP's test routing: top-k of random scores, and the expected layout computed independently."""
    g = torch.Generator().manual_seed(seed * 100 + rank)
    scores = torch.rand((num_tokens, num_experts), generator=g) + 1
    topk_idx = torch.topk(scores, num_topk, dim=-1, sorted=False)[1]
    topk_idx[torch.rand(num_tokens, generator=g) < 0.1, 0] = -1
    rank_of = torch.where(topk_idx >= 0, topk_idx // (num_experts // num_ranks), -1)
    is_token_in_rank = torch.zeros((num_tokens, num_ranks), dtype=torch.bool)
    for r in range(num_ranks):
        is_token_in_rank[:, r] = (rank_of == r).any(1)
    token_idx_in_rank = torch.full((num_tokens, num_ranks), -1, dtype=torch.int32)
    for r in range(num_ranks):
        sel = is_token_in_rank[:, r].nonzero().view(-1)
        token_idx_in_rank[sel, r] = torch.arange(sel.numel(), dtype=torch.int32)
    num_tokens_per_expert = torch.bincount(topk_idx[topk_idx >= 0], minlength=num_experts).int()
    return topk_idx, is_token_in_rank, token_idx_in_rank, num_tokens_per_expert


# ---------------------------------------------------------------------------------------------- the switch
def test_install_as_deep_ep_makes_import_deep_ep_resolve_here():
    code = (
        "import sys, ep_dispatcher\n"
        "assert ep_dispatcher.install_as_deep_ep() is ep_dispatcher\n"
        "import deep_ep\n"
        "from deep_ep import Buffer, Config, EventOverlap\n"
        "from deep_ep.utils import EventHandle, EventOverlap as EO\n"
        "assert deep_ep is ep_dispatcher and Buffer is ep_dispatcher.Buffer and EO is EventOverlap\n"
        "ev = EventOverlap(EventHandle())\n"
        "ev.current_stream_wait()\n"
        "with ev:\n    pass\n"
        "assert Config(24, 8, 256).num_max_nvl_chunked_recv_tokens == 256\n"
        "sys.modules['deep_ep'] = type(sys)('deep_ep')\n"
        "try:\n    ep_dispatcher.install_as_deep_ep()\n"
        "except RuntimeError as e:\n    assert 'already imported' in str(e) and 'force=True' in str(e)\n"
        "else:\n    raise SystemExit('a foreign deep_ep must not be replaced silently')\n"
        "assert ep_dispatcher.install_as_deep_ep(force=True) is sys.modules['deep_ep']\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120, env={**os.environ, "PYTHONPATH": os.getcwd()})


# ---------------------------------------------------------------------------------------------- intranode, DeepEP style
def _intranode_worker(rank: int, num_ranks: int) -> None:
    deep_ep = _deep_ep()
    num_tokens, hidden, num_topk, num_experts = 40, 256, 3, 4 * num_ranks
    x = torch.ones((num_tokens, hidden), dtype=torch.bfloat16) * rank
    x_pure_rand = torch.randn((num_tokens, hidden), generator=torch.Generator().manual_seed(rank)).bfloat16()
    x_e4m3 = per_token_cast_to_fp8(x)
    x_e4m3 = (x_e4m3[0], x_e4m3[1].T.contiguous().T)  # column-major scales, as DeepEP's test passes them
    assert not x_e4m3[1].is_contiguous()
    topk_idx, is_token_in_rank, token_idx_in_rank, num_tokens_per_expert = _routing(
        rank, num_tokens, num_experts, num_topk, num_ranks
    )
    topk_weights = torch.ones((num_tokens, num_topk), dtype=torch.float32) * rank
    num_tokens_per_rank = is_token_in_rank.sum(0).int()
    gbl_num_tokens_per_rank = num_tokens_per_rank.clone()
    dist.all_reduce(gbl_num_tokens_per_rank)
    gbl_num_tokens_per_expert = num_tokens_per_expert.clone()
    dist.all_reduce(gbl_num_tokens_per_expert)

    buffer = deep_ep.Buffer(
        dist.group.WORLD, int(1e8), 0, low_latency_mode=False, num_qps_per_rank=1, explicitly_destroy=True
    )
    ref_per_rank, _, ref_per_expert, ref_in_rank, _ = buffer.get_dispatch_layout(topk_idx, num_experts)
    assert torch.equal(ref_per_rank, num_tokens_per_rank)
    assert torch.equal(ref_per_expert, num_tokens_per_expert)
    assert torch.equal(ref_in_rank, is_token_in_rank)
    config = deep_ep.Config(24, 8, 256)

    def check_data(check_x, rank_prefix_matrix):
        assert torch.equal(check_x.amin(dim=1), check_x.amax(dim=1))
        start = 0
        for i in range(num_ranks):
            end = rank_prefix_matrix[i][rank].item()
            assert (check_x[start:end, :].int() - i).sum().item() == 0
            start = end

    for previous_mode in (False, True):
        for current_x in (x_pure_rand, x, x_e4m3):
            for with_topk in (False, True):
                args = {
                    "x": current_x,
                    "num_tokens_per_rank": num_tokens_per_rank,
                    "is_token_in_rank": is_token_in_rank,
                    "num_tokens_per_expert": num_tokens_per_expert,
                    "config": config,
                    "async_finish": previous_mode,
                }
                if with_topk:
                    args.update({"topk_idx": topk_idx, "topk_weights": topk_weights})
                if previous_mode:
                    args.update({"previous_event": buffer.capture()})
                recv_x, recv_topk_idx, recv_topk_weights, recv_list, handle, event = buffer.dispatch(**args)
                event.current_stream_wait() if previous_mode else ()
                recv_x = per_token_cast_back(*recv_x).bfloat16() if isinstance(recv_x, tuple) else recv_x

                # The handle is DeepEP's 6-tuple.
                assert isinstance(handle, tuple) and len(handle) == 6
                rank_prefix_matrix, channel_prefix, recv_channel_prefix, recv_src_idx, in_rank, send_head = handle
                assert handle[0] is rank_prefix_matrix and handle[-2] is in_rank
                assert torch.equal(in_rank, is_token_in_rank)
                assert gbl_num_tokens_per_rank[rank].item() == recv_x.size(0) == recv_src_idx.size(0)
                # Without top-k too, the list holds what every rank sends to this rank's experts.
                assert gbl_num_tokens_per_expert.view(num_ranks, -1)[rank].tolist() == recv_list
                assert torch.equal(send_head, token_idx_in_rank)  # stand-in: the token's row in this rank's block
                assert torch.equal(channel_prefix.view(-1), num_tokens_per_rank)
                starts = torch.cat([torch.zeros(1, dtype=torch.int32), rank_prefix_matrix[:-1, rank]])
                assert torch.equal(recv_channel_prefix.view(-1), starts)
                if current_x is not x_pure_rand:
                    check_data(recv_x, rank_prefix_matrix)
                if with_topk:
                    for i, count in enumerate(recv_list):
                        assert recv_topk_idx.eq(i).sum().item() == count
                    num_worst = num_tokens * num_ranks
                    worst_x, worst_idx, _, empty_list, _, _ = buffer.dispatch(**args, num_worst_tokens=num_worst)
                    worst_x = per_token_cast_back(*worst_x).bfloat16() if isinstance(worst_x, tuple) else worst_x
                    assert len(empty_list) == 0 and worst_x.size(0) == num_worst
                    assert torch.equal(recv_x, worst_x[: recv_x.size(0)])
                    assert bool((worst_idx[recv_x.size(0) :] == -1).all())
                else:
                    # Cached: the layout arguments are ignored (even wrong ones), the returned handle is None.
                    cached = {
                        "x": current_x,
                        "handle": handle,
                        "config": config,
                        "num_tokens_per_rank": num_tokens_per_rank + 1,
                    }
                    cached_x, _, _, _, no_handle, _ = buffer.dispatch(**cached)
                    assert no_handle is None
                    cached_x = per_token_cast_back(*cached_x).bfloat16() if isinstance(cached_x, tuple) else cached_x
                    assert torch.equal(cached_x, recv_x)
                combine_args = {"x": recv_x, "handle": handle, "config": config}
                if with_topk:
                    combine_args.update({"topk_weights": recv_topk_weights})
                combined_x, combined_w, _ = buffer.combine(**combine_args)
                check_x = combined_x.float() / is_token_in_rank.sum(dim=1).unsqueeze(1).clamp(min=1)
                sent = is_token_in_rank.any(1)
                ref_x = x_pure_rand if current_x is x_pure_rand else x
                assert calc_diff(check_x[sent], ref_x[sent]) < 5e-6  # DeepEP's bound (FP8 of x = rank is exact)
    with pytest.raises(ValueError, match=r"topk_idx: must be None in cached mode"):
        buffer.dispatch(x, handle=handle, topk_idx=topk_idx)
    buffer.destroy()


@pytest.mark.parametrize("world", [2, 4])
def test_intranode_in_deepep_style(world):
    run(_intranode_worker, world)


# ---------------------------------------------------------------------------------------------- internode handle
def _internode_worker(rank: int, num_ranks: int) -> None:
    deep_ep = _deep_ep()
    per_node = 2
    num_tokens, hidden, num_topk, num_experts = 24, 128, 3, 2 * num_ranks
    x = torch.ones((num_tokens, hidden), dtype=torch.bfloat16) * rank
    topk_idx, is_token_in_rank, token_idx_in_rank, num_tokens_per_expert = _routing(
        rank, num_tokens, num_experts, num_topk, num_ranks, seed=3
    )
    buffer = deep_ep.Buffer(dist.group.WORLD, int(1e8), int(1e8), num_ranks_per_node=per_node)
    per_rank, per_rdma, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, num_experts)
    recv_x, _, _, recv_list, handle, _ = buffer.dispatch(
        x,
        num_tokens_per_rank=per_rank,
        num_tokens_per_rdma_rank=per_rdma,
        is_token_in_rank=in_rank,
        num_tokens_per_expert=per_expert,
        topk_idx=topk_idx,
        topk_weights=torch.rand(num_tokens, num_topk),
    )
    assert isinstance(handle, tuple) and len(handle) == 10
    (
        in_rank_h,
        rdma_channel,
        gbl_channel,
        recv_rdma_channel,
        recv_rdma_prefix,
        recv_gbl_channel,
        recv_gbl_rank_prefix_sum,
        recv_src_meta,
        send_rdma_head,
        send_nvl_head,
    ) = handle
    assert in_rank_h is handle[0] and torch.equal(in_rank_h, is_token_in_rank)
    assert handle[-4] is recv_gbl_rank_prefix_sum and recv_gbl_rank_prefix_sum.size(0) == num_ranks
    start = 0
    for i in range(num_ranks):  # DeepEP's test_internode check_data with handle[-4]
        end = recv_gbl_rank_prefix_sum[i].item()
        assert (recv_x[start:end].int() - i).sum().item() == 0
        start = end
    assert start == recv_x.size(0) == recv_src_meta.size(0) == send_nvl_head.size(0)
    assert torch.equal(gbl_channel.view(-1), per_rank)
    assert torch.equal(rdma_channel.view(-1), per_rdma)
    assert int(recv_rdma_prefix[-1]) == recv_x.size(0) and recv_rdma_channel.shape == (num_ranks // per_node, 1)
    in_node = is_token_in_rank.view(num_tokens, -1, per_node).any(2)
    assert torch.equal(send_rdma_head >= 0, in_node)
    assert recv_gbl_channel.shape == (num_ranks, 1)
    combined, _, _ = buffer.combine(recv_x, handle)
    assert torch.equal(combined.float(), x.float() * is_token_in_rank.sum(1, keepdim=True))


def test_internode_handle_is_deepeps_10_tuple():
    run(_internode_worker, 4)


# ---------------------------------------------------------------------------------------------- low latency
def _low_latency_worker(rank: int, num_ranks: int, use_logfmt: bool) -> None:
    deep_ep = _deep_ep()
    num_tokens, hidden, num_topk, num_experts = 8, 512, 3, 2 * num_ranks
    num_local_experts = num_experts // num_ranks
    rank_offset = 128
    g = torch.Generator().manual_seed(rank)
    x = torch.ones((num_tokens, hidden), dtype=torch.bfloat16) * (rank - rank_offset)
    x[:, -128:] = torch.arange(num_tokens).to(torch.bfloat16).view(-1, 1)
    x_small = (torch.randn((num_tokens, hidden), generator=g) * 0.1).bfloat16()  # LogFMT casts these groups
    scores = torch.rand((num_tokens, num_experts), generator=g) + 1
    topk_idx = torch.topk(scores, num_topk, dim=-1, sorted=True)[1]
    topk_idx[1, 2] = -1
    topk_weights = torch.rand((num_tokens, num_topk), generator=g)
    num_rdma_bytes = deep_ep.Buffer.get_low_latency_rdma_size_hint(num_tokens, hidden, num_ranks, num_experts)
    buffer = deep_ep.Buffer(
        dist.group.WORLD,
        num_rdma_bytes=num_rdma_bytes,
        low_latency_mode=True,
        num_qps_per_rank=num_local_experts,
        explicitly_destroy=True,
    )
    all_topk_idx = [torch.empty_like(topk_idx) for _ in range(num_ranks)]
    dist.all_gather(all_topk_idx, topk_idx)
    all_topk_idx = torch.stack(all_topk_idx)
    for current_x in (x, x_small):
        for return_recv_hook in (False, True):
            for use_fp8 in (False, True):
                stats = torch.zeros((num_local_experts,), dtype=torch.int)
                wait_stats = torch.full((num_ranks,), 7, dtype=torch.int64)
                packed_recv_x, packed_recv_count, handle, event, hook = buffer.low_latency_dispatch(
                    current_x,
                    topk_idx,
                    num_tokens,
                    num_experts,
                    cumulative_local_expert_recv_stats=stats,
                    dispatch_wait_recv_cost_stats=wait_stats,
                    use_fp8=use_fp8,
                    async_finish=not return_recv_hook,
                    return_recv_hook=return_recv_hook,
                )
                hook() if return_recv_hook else event.current_stream_wait()
                assert torch.equal(wait_stats, torch.full((num_ranks,), 7))  # reference: adds 0 (documented)
                assert isinstance(handle, tuple) and len(handle) == 5
                src_info, layout_range, max_tokens, hidden_h, experts_h = handle
                assert (max_tokens, hidden_h, experts_h) == (num_tokens, hidden, num_experts)
                simulated = (
                    per_token_cast_back(packed_recv_x[0].view(-1, hidden), packed_recv_x[1].reshape(-1, hidden // 128))
                    .view(packed_recv_x[0].shape)
                    .bfloat16()
                    if use_fp8
                    else packed_recv_x.clone()
                )
                for i in range(num_local_experts):
                    expert_id = rank * num_local_experts + i
                    count, recv_src_info, recv_layout_range = packed_recv_count[i].item(), handle[0][i], handle[1][i]
                    assert stats[i].item() == count == (all_topk_idx == expert_id).sum().item()
                    assert count == (recv_layout_range & (2**32 - 1)).sum().item()
                    if current_x is x and count:
                        rows = simulated[i, :count]
                        assert (rows[:, -128:] - recv_src_info[:count].view(-1, 1) % num_tokens).sum().item() == 0
                        for j in range(num_ranks):
                            begin, n = (recv_layout_range[j] >> 32).item(), (recv_layout_range[j] & (2**32 - 1)).item()
                            assert (rows[begin : begin + n, :-128].float() - j + rank_offset).abs().sum().item() == 0
                for zero_copy in (False, True):
                    if zero_copy:
                        buffer.get_next_low_latency_combine_buffer(handle)[:, :, :] = simulated
                    poisoned = torch.full_like(simulated, float("nan")) if zero_copy else simulated  # x is not read
                    out = torch.empty((num_tokens, hidden), dtype=torch.bfloat16)
                    combine_stats = torch.zeros((num_ranks,), dtype=torch.int64)
                    combined_x, event, hook = buffer.low_latency_combine(
                        poisoned,
                        topk_idx,
                        topk_weights,
                        handle,
                        use_logfmt=use_logfmt,
                        zero_copy=zero_copy,
                        async_finish=not return_recv_hook,
                        return_recv_hook=return_recv_hook,
                        out=out,
                        combine_wait_recv_cost_stats=combine_stats,
                    )
                    hook() if return_recv_hook else event.current_stream_wait()
                    assert combined_x is out and not torch.isnan(combined_x).any()
                    expected = current_x.float() * topk_weights.masked_fill(topk_idx == -1, 0).sum(dim=1, keepdim=True)
                    diff = calc_diff(expected, combined_x)
                    assert diff < (9e-4 if use_fp8 else 1e-5), (diff, use_fp8, zero_copy, use_logfmt)  # DeepEP's bounds
                    if use_logfmt and current_x is x_small and not zero_copy:
                        # The format did apply: the plain BF16 combine of the same data differs.
                        plain, _, hook = buffer.low_latency_combine(
                            simulated, topk_idx, topk_weights, handle, return_recv_hook=True
                        )
                        hook()
                        assert not torch.equal(plain, combined_x)
    buffer.destroy()


@pytest.mark.parametrize("world, use_logfmt", [(2, False), (2, True), (4, True)])
def test_low_latency_in_deepep_style(world, use_logfmt):
    run(_low_latency_worker, world, use_logfmt)


# ---------------------------------------------------------------------------------------------- LogFMT format
def _logfmt_scalar(values):
    """Independent per-element LogFMT-10 of one 128-channel group (plain Python floats)."""
    mags = [abs(v) for v in values]
    amax, amin = max(mags), min(mags)
    log_amax = math.log2(amax) if amax > 0 else -math.inf
    log_amin = log_amax - 32 if amin == 0 else max(math.log2(amin), log_amax - 32)
    if not (log_amax < 0 and log_amin < log_amax):
        return list(values)
    step = (log_amax - log_amin) / 510
    rounding = 2 - math.log2((1 + 2**step) / 2) / step
    out = []
    for v, a in zip(values, mags):
        code = 0 if a == 0 else min(math.floor(max((math.log2(a) - log_amin) / step + rounding, 0)), 511)
        d = 0.0 if code == 0 else 2 ** ((code - 1) * step + log_amin)
        out.append(-d if math.copysign(1, v) < 0 else d)
    return out


def test_logfmt_roundtrip_is_the_documented_format():
    g = torch.Generator().manual_seed(5)
    x = torch.randn((3, 4 * LOGFMT_GROUP_SIZE), generator=g) * 0.3
    x[0, :LOGFMT_GROUP_SIZE] *= 10  # a group with |x| >= 1: stays BF16
    x[1, LOGFMT_GROUP_SIZE : 2 * LOGFMT_GROUP_SIZE] = 0.25  # a constant group: stays BF16
    x[2, 5] = 0.0  # a zero: the range then spans 32 binades below amax
    x = x.bfloat16()
    y = logfmt_roundtrip(x)
    assert y.dtype == torch.bfloat16 and y.shape == x.shape
    expected = (
        torch.tensor(
            [_logfmt_scalar(group) for group in x.double().view(-1, LOGFMT_GROUP_SIZE).tolist()], dtype=torch.float64
        )
        .bfloat16()
        .view(x.shape)
    )
    assert torch.equal(y, expected)
    assert torch.equal(y[0, :LOGFMT_GROUP_SIZE], x[0, :LOGFMT_GROUP_SIZE])
    assert torch.equal(y[1, LOGFMT_GROUP_SIZE : 2 * LOGFMT_GROUP_SIZE], x[1, LOGFMT_GROUP_SIZE : 2 * LOGFMT_GROUP_SIZE])
    assert not torch.equal(y, x)  # the cast groups did change
    assert float(((y.float() - x.float()).abs() / x.float().abs().clamp(min=1e-3)).max()) < 0.05
    with pytest.raises(TypeError, match="x: LogFMT takes a bfloat16 tensor, got torch.float32"):
        logfmt_roundtrip(x.float())
    with pytest.raises(ValueError, match="x: LogFMT needs the last dimension to be a multiple of 128"):
        logfmt_roundtrip(x[:, :100])


# ---------------------------------------------------------------------------------------------- payload formats
def _payload_worker(rank: int, num_ranks: int) -> None:
    deep_ep = _deep_ep()
    num_tokens, hidden, num_experts = 12, 1024, 2 * num_ranks
    topk_idx, _, _, _ = _routing(rank, num_tokens, num_experts, 2, num_ranks, seed=7)
    buffer = deep_ep.Buffer(dist.group.WORLD, int(1e8))
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, num_experts)
    layout = {"num_tokens_per_rank": per_rank, "is_token_in_rank": in_rank, "num_tokens_per_expert": per_expert}
    g = torch.Generator().manual_seed(rank)
    src = torch.randn((num_tokens, hidden), generator=g).bfloat16()
    data, scales = per_token_cast_to_fp8(src, round_scale=True, use_ue8m0=True)  # int32 [N, H/512], packed UE8M0
    payloads = {
        "uint8": torch.randint(0, 256, (num_tokens, 48), generator=g, dtype=torch.uint8),
        "ue8m0_column_major": (data, scales.T.contiguous().T),
        "per_token_scale": (data, torch.rand((num_tokens, 1), generator=g)),
        "per_128_scale": per_token_cast_to_fp8(src),
    }
    token_ids = torch.arange(num_tokens, dtype=torch.int32) + 1000 * rank
    ids, _, _, _, handle, _ = buffer.dispatch(token_ids.view(-1, 1).expand(-1, 4).contiguous(), **layout)
    for name, payload in payloads.items():
        recv, _, _, _, _, _ = buffer.dispatch(payload, **layout)
        cached, _, _, _, _, _ = buffer.dispatch(payload, handle=handle)
        rows = ids[:, 0].long()
        for got in (recv, cached):
            # Each received row is the source token's row, byte for byte (sources gathered from every rank).
            parts = got if isinstance(got, tuple) else (got,)
            sources = payload if isinstance(payload, tuple) else (payload,)
            for part, source in zip(parts, sources):
                assert part.dtype == source.dtype, name
                source = source.contiguous().view(torch.uint8)  # gloo has no float8 collectives
                everyone = [torch.empty_like(source) for _ in range(num_ranks)]
                dist.all_gather(everyone, source)
                want = torch.cat(everyone)[(rows // 1000) * num_tokens + rows % 1000]
                assert part.is_contiguous(), name
                assert torch.equal(part.view(torch.uint8), want.view(torch.uint8)), name


@pytest.mark.parametrize("world", [2, 4])
def test_payload_formats_as_deepep(world):
    run(_payload_worker, world)


# ---------------------------------------------------------------------------------------------- missing names
def _names_worker(rank: int, num_ranks: int) -> None:
    deep_ep = _deep_ep()
    assert deep_ep.Buffer.is_sm90_compiled() is True  # reference backend: FP8 runs in PyTorch
    buffer = deep_ep.Buffer(dist.group.WORLD, 4096, 1024)
    assert buffer.get_comm_stream() is None  # no CUDA here
    t = buffer.get_local_buffer_tensor(torch.float32)
    assert t.dtype == torch.float32 and t.numel() == 1024
    t[:] = rank  # persistent: the same memory next time
    view = buffer.get_local_buffer_tensor(torch.bfloat16, torch.Size([4, 8]), offset=2)
    assert view.shape == (4, 8)
    assert buffer.get_local_buffer_tensor(torch.int32, use_rdma_buffer=True).numel() == 256
    assert torch.equal(buffer.get_local_buffer_tensor(torch.float32), torch.full((1024,), float(rank)))
    with pytest.raises(ValueError, match=r"size: \[100, 100\] needs 10000 elements"):
        buffer.get_local_buffer_tensor(torch.float32, torch.Size([100, 100]))
    # DeepEP's internal internode_dispatch/internode_combine (its positional order) forward to dispatch/combine.
    topk_idx = torch.tensor([[rank], [(rank + 1) % num_ranks]], dtype=torch.int64)
    big = deep_ep.Buffer(dist.group.WORLD, int(1e8))
    per_rank, _, per_expert, in_rank, _ = big.get_dispatch_layout(topk_idx, num_ranks)
    x = torch.randn((2, 16), generator=torch.Generator().manual_seed(rank)).bfloat16()
    recv, _, _, recv_list, handle, _ = big.internode_dispatch(x, None, per_rank, None, in_rank, per_expert)
    assert recv_list == [2] and recv.shape == (2, 16)
    combined, _, _ = big.internode_combine(recv, handle)
    assert torch.equal(combined, x)
    runtime = buffer.runtime
    assert runtime.is_available() and runtime.get_num_rdma_ranks() == 1 and runtime.get_rdma_rank() == 0
    assert runtime.get_local_device_id() == -1 and runtime.get_local_buffer_tensor(torch.uint8).numel() == 4096
    ll_bytes = deep_ep.Buffer.get_low_latency_rdma_size_hint(4, 128, num_ranks, num_ranks)
    ll = deep_ep.Buffer(dist.group.WORLD, 0, ll_bytes, low_latency_mode=True)
    with pytest.raises(ValueError, match=r"dispatch_wait_recv_cost_stats: expected shape \[%d\]" % num_ranks):
        ll.low_latency_dispatch(
            torch.randn(4, 128).bfloat16(),
            torch.zeros((4, 1), dtype=torch.int64),
            4,
            num_ranks,
            dispatch_wait_recv_cost_stats=torch.zeros((num_ranks, num_ranks), dtype=torch.int64),
        )


def test_missing_names_exist():
    run(_names_worker, 2)


# ---------------------------------------------------------------------------------------------- comm=
class _StandInComm:
    """What Buffer needs of an mpi4py communicator (Get_rank, Get_size, allgather), over a TCPStore."""

    def __init__(self, rank: int, size: int, port: int):
        self.rank, self.size, self.round = rank, size, 0
        self.store = dist.TCPStore("127.0.0.1", port, size, rank == 0)

    def Get_rank(self):  # noqa: N802  (mpi4py's names)
        return self.rank

    def Get_size(self):  # noqa: N802
        return self.size

    def allgather(self, obj):
        import pickle

        self.round += 1
        self.store.set(f"{self.round}/{self.rank}", pickle.dumps(obj))
        return [pickle.loads(self.store.get(f"{self.round}/{r}")) for r in range(self.size)]


def _comm_worker(rank: int, num_ranks: int, port: int) -> None:
    deep_ep = _deep_ep()
    comm = _StandInComm(rank, num_ranks, port)
    # torch.distributed already initialised: the communicator's members map onto the default group.
    buffer = deep_ep.Buffer(None, int(1e8), comm=comm)
    assert buffer.group is dist.group.WORLD and buffer.rank == rank and buffer.num_ranks == num_ranks
    # Not initialised: the default group is created from the communicator, and the buffer works over it.
    dist.destroy_process_group()
    buffer = deep_ep.Buffer(None, int(1e8), comm=comm)
    assert dist.is_initialized() and dist.get_rank() == rank and dist.get_world_size() == num_ranks
    topk_idx = torch.tensor([[rank], [(rank + 1) % num_ranks]], dtype=torch.int64)
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, num_ranks)
    x = torch.full((2, 16), float(rank)).bfloat16()
    recv, _, _, recv_list, handle, _ = buffer.dispatch(
        x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert
    )
    assert recv_list == [2] and sorted(recv[:, 0].tolist()) == sorted([float(rank), float((rank - 1) % num_ranks)])
    with pytest.raises(TypeError, match=r"comm: expected an mpi4py.MPI.Comm \(with Get_rank\(\)\), got object"):
        deep_ep.Buffer(None, comm=object())


def test_comm_argument_with_a_stand_in_communicator():
    run(_comm_worker, 2, free_port())


# ------------------------------------------------------------------------------------------ Megatron flex, no plugin
def _megatron_flex_worker(rank: int, world: int) -> float:
    warnings.filterwarnings("ignore")
    import ep_dispatcher

    ep_dispatcher.install_as_deep_ep()  # the switch, and nothing else
    from megatron.core import parallel_state
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.transformer.moe import fused_a2a
    from megatron.core.transformer.moe.token_dispatcher import MoEFlexTokenDispatcher
    from megatron.core.transformer.transformer_config import TransformerConfig

    from ep_dispatcher.megatron import cpu_shim, is_installed, uninstall

    uninstall()  # importing the package for its CPU shim installed our plugin: take it out again
    assert not is_installed() and fused_a2a.HAVE_DEEP_EP
    cpu_shim.enable()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, expert_model_parallel_size=world)
    common = dict(
        num_layers=1,
        hidden_size=16,
        num_attention_heads=2,
        num_moe_experts=8,
        moe_router_topk=2,
        moe_ffn_hidden_size=32,
        use_cpu_initialization=True,
        moe_aux_loss_coeff=0.0,
        add_bias_linear=False,
        expert_model_parallel_size=world,
        moe_router_dtype="fp32",
    )
    layers = {}
    for kind, extra in (("allgather", {}), ("flex", {"moe_flex_dispatcher_backend": "deepep"})):
        config = TransformerConfig(moe_token_dispatcher_type=kind, **common, **extra)
        torch.manual_seed(0)
        layers[kind] = get_moe_module_spec(use_te=False, num_experts=8, moe_grouped_gemm=False)(config=config)
    assert isinstance(layers["flex"].token_dispatcher, MoEFlexTokenDispatcher)
    losses = {}
    for kind, layer in layers.items():
        opt = torch.optim.SGD(layer.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(rank)
        losses[kind] = []
        for _ in range(3):  # a few training steps
            x = torch.randn((6, 2, 16), generator=g)
            out, _ = layer(x)
            loss = (out.float() ** 2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses[kind].append(float(loss))
    torch.testing.assert_close(losses["flex"], losses["allgather"], rtol=1e-5, atol=1e-7)
    assert isinstance(fused_a2a._buffer, ep_dispatcher.Buffer)  # Megatron's own get_buffer made one of ours
    return losses["flex"][-1]


def test_megatron_flex_dispatcher_trains_through_the_switch_alone():
    pytest.importorskip("megatron.core")
    run(_megatron_flex_worker, 2)
