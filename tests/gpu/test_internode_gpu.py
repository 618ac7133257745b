"""Internode CUDA engine (NVSHMEM) vs the reference backend, bit for bit, with virtual nodes on one GPU.

Ranks are grouped into "nodes" of ``num_ranks_per_node`` consecutive ranks (4 = 2 x 2, 8 = 2 x 4 and 4 x 2): the
RDMA leg (NVSHMEM puts between ranks of different nodes) and the NVLink leg (direct stores inside a node) both run
on the one GPU. Run under MPS (tests/gpu/run_device.sh does that). Every worker collects its mismatches in a list
and raises only at the end, after the last collective, so one rank's failure cannot leave its peers hanging.
"""

from __future__ import annotations

import hashlib
import os

import pytest
import torch

from tests import reference_cases as rc
from ep_dispatcher.launch import use_nvshmem_on_one_machine
from tests.dist import run
from tests.gpu.common import NUM_SMS, require_extension, set_device, where_differs
from tests.poison import poison_allocator

pytestmark = pytest.mark.gpu
_C = require_extension(nvshmem=True)

from ep_dispatcher import Buffer, Config, per_token_cast_to_fp8  # noqa: E402

# (world, ranks per node); EP_GPU_INTERNODE_CONFIGS="4x2,8x4" picks a subset.
CONFIGS = [
    tuple(int(v) for v in item.split("x"))
    for item in os.environ.get("EP_GPU_INTERNODE_CONFIGS", "4x2,8x4,8x2").split(",")
]
NUM_NVL_BYTES = 1 << 30  # the Buffer checks the NVLink hint; the internode engine allocates none of it
MAX_TOKENS = 512  # >= tokens any rank passes in these tests (random cases have <= 300)
MAX_HIDDEN_BYTES = 7168 * 4  # fp32 combine of hidden 7168
POISON_BYTES = 64 << 20
KERNEL_TIMEOUT_S = float(os.environ.get("EP_GPU_KERNEL_TIMEOUT_S", "60"))  # a lost signal fails a test this fast


def _setup(rank: int, per_node: int) -> torch.device:
    os.environ["EP_DISPATCHER_RANKS_PER_NODE"] = str(per_node)
    # One GPU, no NIC: P2P transport only, no NVLink multicast, bootstrap over loopback.
    use_nvshmem_on_one_machine()
    return set_device(rank)


def _buffers(world: int, per_node: int):
    rdma = Config().get_rdma_buffer_size_hint(MAX_HIDDEN_BYTES, world, per_node, num_max_tokens_per_rank=MAX_TOKENS)
    cuda = Buffer(None, num_nvl_bytes=NUM_NVL_BYTES, num_rdma_bytes=rdma, backend="cuda", timeout_s=KERNEL_TIMEOUT_S)
    ref = Buffer(None, num_nvl_bytes=NUM_NVL_BYTES, backend="reference")
    assert cuda.is_internode and cuda.num_ranks_per_node == per_node
    assert {"dispatch", "cached_dispatch", "combine"} <= set(cuda.engine_calls), cuda.engine_calls
    return cuda, ref


def _same(errors: list, what: str, a, b) -> None:
    if a is None or b is None:
        if not (a is None and b is None):
            errors.append(f"{what}: one side is None")
        return
    if isinstance(a, torch.Tensor):
        if a.dtype == torch.float8_e4m3fn:
            a, b = a.view(torch.uint8), b.view(torch.uint8)
        if a.shape != b.shape or a.dtype != b.dtype:
            errors.append(f"{what}: differs (shapes {tuple(a.shape)} vs {tuple(b.shape)}, {a.dtype} vs {b.dtype})")
        elif not torch.equal(a.cpu(), b.cpu()):
            errors.append(f"{what}: differs ({where_differs(a.cpu(), b.cpu())})")
    elif a != b:
        errors.append(f"{what}: {a!r} != {b!r}")


def _compare_case(cuda: Buffer, ref: Buffer, case: rc.Case, me: int, per_node: int, device, errors: list) -> None:
    inputs = [rc.rank_inputs(case, r) for r in range(case.num_ranks)]
    x, topk_idx, topk_weights = (t.to(device) for t in inputs[me])
    config = Config(NUM_SMS)
    tag = f"seed {case.seed} hidden {case.hidden}"

    poison_allocator(POISON_BYTES, device)
    layout_c = cuda.get_dispatch_layout(topk_idx, case.num_experts)
    layout_r = ref.get_dispatch_layout(topk_idx, case.num_experts)
    for name, a, b in zip(("per_rank", "per_node", "per_expert", "in_rank"), layout_c[:4], layout_r[:4]):
        _same(errors, f"{tag} layout {name}", a, b)
    # Per-node counts, loop-level: a token counts once per node holding one of its experts.
    expected_nodes = torch.zeros(case.num_ranks // per_node, dtype=torch.int32)
    for t in range(x.size(0)):
        for node in {int(e) // case.num_local_experts // per_node for e in inputs[me][1][t] if e >= 0}:
            expected_nodes[node] += 1
    _same(errors, f"{tag} num_tokens_per_rdma_rank vs loop", layout_c[1].cpu(), expected_nodes)

    per_rank, per_rdma, per_expert, in_rank, _ = layout_c
    alignment = 1 + case.seed % 3
    kwargs = dict(
        num_tokens_per_rank=per_rank,
        num_tokens_per_rdma_rank=per_rdma,
        is_token_in_rank=in_rank,
        num_tokens_per_expert=per_expert,
        topk_idx=topk_idx,
        topk_weights=topk_weights,
        expert_alignment=alignment,
    )
    poison_allocator(POISON_BYTES, device)
    out_c = cuda.dispatch(x, config=config, **kwargs)
    out_r = ref.dispatch(x, **kwargs)
    for name, a, b in zip(("recv_x", "recv_topk_idx", "recv_topk_weights", "per_expert_list"), out_c[:4], out_r[:4]):
        _same(errors, f"{tag} dispatch {name}", a, b)
    hc, hr = out_c[4], out_r[4]
    _same(errors, f"{tag} rank_prefix_matrix", hc.rank_prefix_matrix, hr.rank_prefix_matrix)
    _same(errors, f"{tag} recv_src_idx", hc.recv_src_idx, hr.recv_src_idx)
    _same(errors, f"{tag} num_recv_tokens_per_expert", hc.num_recv_tokens_per_expert, hr.num_recv_tokens_per_expert)
    _same(errors, f"{tag} num_recv_tokens", hc.num_recv_tokens, hr.num_recv_tokens)

    # Combine: bias pair and weights, bit-exact (both follow the multi-node order of Buffer.combine).
    g = torch.Generator().manual_seed(case.seed + 5)
    biases = tuple(
        (torch.randn((x.size(0), case.hidden), generator=g) * 2).to(torch.bfloat16).to(device) for _ in range(2)
    )
    y = rc.expert_fn(me, out_r[0])
    poison_allocator(POISON_BYTES, device)
    comb_c = cuda.combine(y, hc, topk_weights=out_r[2], bias=biases, config=config)
    comb_r = ref.combine(y, hr, topk_weights=out_r[2], bias=biases)
    _same(errors, f"{tag} combined_x (bias pair)", comb_c[0], comb_r[0])
    _same(errors, f"{tag} combined_topk_weights", comb_c[1], comb_r[1])
    poison_allocator(POISON_BYTES, device)
    _same(
        errors,
        f"{tag} combined_x (one bias)",
        cuda.combine(y, hc, bias=biases[0], config=config)[0],
        ref.combine(y, hr, bias=biases[0])[0],
    )
    _same(errors, f"{tag} combined_x (no bias)", cuda.combine(y, hc, config=config)[0], ref.combine(y, hr)[0])
    y32 = out_r[0].float() * 0.5 - 0.25
    _same(errors, f"{tag} fp32 combine", cuda.combine(y32, hc, config=config)[0], ref.combine(y32, hr)[0])

    # Cached dispatch reproduces the layout for other data.
    x2 = (x.float() * 3 - 1).to(torch.bfloat16)
    poison_allocator(POISON_BYTES, device)
    cached_c = cuda.dispatch(x2, handle=hc, config=config)[0]
    _same(errors, f"{tag} cached dispatch", cached_c, ref.dispatch(x2, handle=hr)[0])

    # FP8 payloads (data, scales), fresh and cached.
    if case.hidden % 128 == 0:
        x8 = per_token_cast_to_fp8(x)
        plain = dict(num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma, is_token_in_rank=in_rank)
        poison_allocator(POISON_BYTES, device)
        (d_c, s_c), _, _, _, h8c, _ = cuda.dispatch(x8, config=config, **plain)
        (d_r, s_r), _, _, _, h8r, _ = ref.dispatch(x8, **plain)
        _same(errors, f"{tag} fp8 data", d_c, d_r)
        _same(errors, f"{tag} fp8 scales", s_c, s_r)
        (d_c, s_c), *_ = cuda.dispatch(x8, handle=hc, config=config)
        (d_r, s_r), *_ = ref.dispatch(x8, handle=hr)
        _same(errors, f"{tag} cached fp8 data", d_c, d_r)
        _same(errors, f"{tag} cached fp8 scales", s_c, s_r)
        # Combine after a dispatch without top-k.
        y8 = rc.expert_fn(me, out_r[0])
        _same(
            errors, f"{tag} combine of an fp8 handle", cuda.combine(y8, h8c, config=config)[0], ref.combine(y8, h8r)[0]
        )

    # num_worst_tokens: no host sync; valid rows equal, padding rows marked.
    worst = sum(case.tokens_per_rank) + 5
    poison_allocator(POISON_BYTES, device)
    wc = cuda.dispatch(x, num_worst_tokens=worst, config=config, **kwargs)
    n = hr.num_recv_tokens
    if wc[0].size(0) != worst or wc[3] != [] or wc[4].num_recv_tokens != -1:
        errors.append(f"{tag} worst-mode shapes/list/num_recv_tokens")
    else:
        _same(errors, f"{tag} worst recv_x", wc[0][:n], out_r[0])
        _same(errors, f"{tag} worst recv_topk_idx", wc[1][:n], out_r[1])
        _same(errors, f"{tag} worst recv_topk_weights", wc[2][:n], out_r[2])
        if not (
            bool((wc[1][n:] == -1).all())
            and bool((wc[2][n:] == 0).all())
            and bool((wc[4].recv_src_idx[n:] == -1).all())
        ):
            errors.append(f"{tag} worst-mode padding rows not marked")
        _same(errors, f"{tag} worst per-expert counts", wc[4].num_recv_tokens_per_expert, hr.num_recv_tokens_per_expert)
        yw = torch.cat([rc.expert_fn(me, out_r[0]), torch.zeros_like(wc[0][n:])])
        expected = ref.combine(rc.expert_fn(me, out_r[0]), hr, bias=biases)[0]
        _same(errors, f"{tag} worst-mode combine", cuda.combine(yw, wc[4], bias=biases, config=config)[0], expected)


def _compare_worker(rank: int, world: int, per_node: int, seeds) -> list:
    device = _setup(rank, per_node)
    cuda, ref = _buffers(world, per_node)
    errors: list = []
    for seed in seeds:
        case = rc.random_case(seed, world, hidden_choices=(2048, 7168, 1024 + 8))
        try:
            _compare_case(cuda, ref, case, rank, per_node, device, errors)
        except Exception as e:  # noqa: BLE001 - reported after the last collective
            errors.append(f"seed {seed}: {type(e).__name__}: {e}")
            break  # the ranks' call sequences may now differ: stop issuing collectives
    torch.cuda.synchronize()
    cuda.destroy()
    return [f"rank {rank}: {e}" for e in errors]


@pytest.mark.parametrize("world,per_node", CONFIGS)
def test_internode_matches_reference(world: int, per_node: int) -> None:
    seeds = [7000 + world * 10 + per_node + 100 * i for i in range(4)]
    errors = [e for rank_errors in run(_compare_worker, world, per_node, seeds) for e in rank_errors]
    assert not errors, "\n".join(errors[:40])


def _stress_worker(rank: int, world: int, per_node: int, iterations: int) -> tuple:
    """Changing routings, every result compared with the reference; returns (errors, digest of the engine outputs)."""
    device = _setup(rank, per_node)
    cuda, ref = _buffers(world, per_node)
    config = Config(NUM_SMS)
    num_tokens, hidden, num_experts, topk = 256, 2048, 4 * world, 4
    errors: list = []
    digest, digest_ref = hashlib.sha256(), hashlib.sha256()
    for it in range(iterations):
        g = torch.Generator().manual_seed(it * 100 + rank)
        n = num_tokens - (it * 37 + rank * 11) % 64 if (it + rank) % 9 else 0  # sizes change, some ranks send nothing
        x = torch.randn((n, hidden), generator=g).to(torch.bfloat16).to(device)
        scores = torch.rand((n, num_experts), generator=g)
        if it % 3 == 0:
            scores[:, : 2 * topk] += 1.0  # skewed onto node 0
        topk_idx = scores.argsort(1, descending=True)[:, :topk]
        topk_idx = topk_idx.masked_fill(torch.rand((n, topk), generator=g) < 0.15, -1).to(device)
        topk_weights = torch.rand((n, topk), generator=g).to(device)
        try:
            per_rank, per_rdma, per_expert, in_rank, _ = cuda.get_dispatch_layout(topk_idx, num_experts)
            kwargs = dict(
                num_tokens_per_rank=per_rank,
                num_tokens_per_rdma_rank=per_rdma,
                is_token_in_rank=in_rank,
                num_tokens_per_expert=per_expert,
                topk_idx=topk_idx,
                topk_weights=topk_weights,
            )
            rc_ = cuda.dispatch(x, config=config, **kwargs)
            rr = ref.dispatch(x, **kwargs)
            _same(errors, f"iteration {it} recv_x", rc_[0], rr[0])
            _same(errors, f"iteration {it} recv_topk_idx", rc_[1], rr[1])
            y = rc.expert_fn(rank, rr[0])
            cc = cuda.combine(y, rc_[4], topk_weights=rr[2], config=config)
            cr = ref.combine(y, rr[4], topk_weights=rr[2])
            _same(errors, f"iteration {it} combined_x", cc[0], cr[0])
            _same(errors, f"iteration {it} combined_w", cc[1], cr[1])
            for t in (rc_[0], cc[0], cc[1]):
                digest.update(t.contiguous().view(torch.uint8).cpu().numpy().tobytes())
            for t in (rr[0], cr[0], cr[1]):
                digest_ref.update(t.contiguous().view(torch.uint8).cpu().numpy().tobytes())
        except Exception as e:  # noqa: BLE001
            errors.append(f"iteration {it}: {type(e).__name__}: {e}")
            break
    torch.cuda.synchronize()
    cuda.destroy()
    return [f"rank {rank}: {e}" for e in errors], digest.hexdigest(), digest_ref.hexdigest()


@pytest.mark.parametrize("world,per_node", CONFIGS)
def test_internode_stress(world: int, per_node: int) -> None:
    iterations = int(os.environ.get("EP_GPU_STRESS_ITERATIONS", "100"))
    results = run(_stress_worker, world, per_node, iterations)
    errors = [e for rank_errors, _, _ in results for e in rank_errors]
    assert not errors, "\n".join(errors[:40])
    assert [d for _, d, _ in results] == [d for _, _, d in results], "engine and reference hashes differ"


def _graph_worker(rank: int, world: int, per_node: int, iterations: int) -> list:
    """CUDA-graph replay of a worst-case dispatch + combine with new inputs equals the eager calls."""
    device = _setup(rank, per_node)
    cuda, _ = _buffers(world, per_node)
    config = Config(NUM_SMS)
    num_tokens, hidden, num_experts, topk = 128, 1024, 4 * world, 4
    worst = num_tokens * world
    x = torch.empty((num_tokens, hidden), dtype=torch.bfloat16, device=device)
    topk_idx = torch.empty((num_tokens, topk), dtype=torch.int64, device=device)
    topk_weights = torch.empty((num_tokens, topk), dtype=torch.float32, device=device)

    def fill(seed: int) -> None:
        g = torch.Generator().manual_seed(seed * 100 + rank)
        x.copy_(torch.randn((num_tokens, hidden), generator=g).to(torch.bfloat16))
        topk_idx.copy_(torch.rand((num_tokens, num_experts), generator=g).argsort(1)[:, :topk])
        topk_idx.masked_fill_(torch.rand((num_tokens, topk), generator=g).to(device) < 0.1, -1)
        topk_weights.copy_(torch.rand((num_tokens, topk), generator=g))

    def step():
        per_rank, per_rdma, per_expert, in_rank, _ = cuda.get_dispatch_layout(topk_idx, num_experts)
        recv_x, _, recv_w, _, handle, _ = cuda.dispatch(
            x,
            num_tokens_per_rank=per_rank,
            num_tokens_per_rdma_rank=per_rdma,
            is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert,
            topk_idx=topk_idx,
            topk_weights=topk_weights,
            num_worst_tokens=worst,
            config=config,
        )
        out, out_w, _ = cuda.combine(recv_x, handle, topk_weights=recv_w, config=config)
        return out, out_w

    errors: list = []
    try:
        fill(0)
        cuda.validate_inputs = False  # no host reads inside the graph
        step()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out_g, w_g = step()
        for it in range(iterations):
            fill(it + 1)
            graph.replay()
            torch.cuda.synchronize()
            out_e, w_e = step()
            _same(errors, f"graph replay {it} combined_x", out_g, out_e)
            _same(errors, f"graph replay {it} combined_w", w_g, w_e)
            if errors:
                break
    except Exception as e:  # noqa: BLE001
        errors.append(f"{type(e).__name__}: {e}")
    torch.cuda.synchronize()
    cuda.destroy()
    return [f"rank {rank}: {e}" for e in errors]


@pytest.mark.parametrize("world,per_node", CONFIGS[:1])
def test_internode_graph_replay(world: int, per_node: int) -> None:
    errors = [e for rank_errors in run(_graph_worker, world, per_node, 10) for e in rank_errors]
    assert not errors, "\n".join(errors[:40])


def _limits_worker(rank: int, world: int, per_node: int) -> list:
    """A Buffer too small for the call raises a ValueError naming num_rdma_bytes, on every rank, before any kernel."""
    device = _setup(rank, per_node)
    small = Config().get_rdma_buffer_size_hint(2048 * 2, world, per_node, num_max_tokens_per_rank=16)
    cuda = Buffer(None, num_nvl_bytes=NUM_NVL_BYTES, num_rdma_bytes=small, backend="cuda", timeout_s=30)
    errors: list = []
    x = torch.zeros((64, 2048), dtype=torch.bfloat16, device=device)
    topk_idx = torch.zeros((64, 1), dtype=torch.int64, device=device)
    per_rank, per_rdma, _, in_rank, _ = cuda.get_dispatch_layout(topk_idx, world)
    try:
        cuda.dispatch(x, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma, is_token_in_rank=in_rank)
        errors.append("a dispatch of 64 tokens into a 16-token buffer did not raise")
    except ValueError as e:
        if "num_rdma_bytes" not in str(e):
            errors.append(f"unexpected message: {e}")
    torch.cuda.synchronize()
    cuda.destroy()
    return [f"rank {rank}: {e}" for e in errors]


def test_internode_buffer_too_small_raises() -> None:
    world, per_node = CONFIGS[0]
    errors = [e for rank_errors in run(_limits_worker, world, per_node) for e in rank_errors]
    assert not errors, "\n".join(errors)
