"""ep_dispatcher._C.get_dispatch_layout against an independent pure-torch reference (bit-exact).

The reference below is written here on purpose (scatter based, checked against a plain Python loop), so that this
test does not share code, or mistakes, with ep_dispatcher/backends/reference.py.
"""

from __future__ import annotations

import pytest
import torch

from tests.gpu.common import require_extension

pytestmark = pytest.mark.gpu
_C = require_extension()

from tests.poison import poison_allocator  # noqa: E402

NUM_RANKS_PER_NODE = 8  # one NVLink domain of 8 GPUs: 16 and 32 ranks produce a per-node (RDMA) output


# ---------------------------------------------------------------------------------------------------------------------
# Reference
# ---------------------------------------------------------------------------------------------------------------------
def reference_layout(
    topk_idx: torch.Tensor, num_experts: int, num_ranks: int, num_ranks_per_node: int
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """Scatter-based layout on the CPU. topk_idx: [num_tokens, num_topk] int64, -1 = no expert."""
    topk_idx = topk_idx.cpu()
    num_tokens, num_topk = topk_idx.shape
    num_local_experts = num_experts // num_ranks
    valid = (topk_idx >= 0) & (topk_idx < num_experts)
    experts = topk_idx[valid]
    token_of_entry = torch.arange(num_tokens).unsqueeze(1).expand(num_tokens, num_topk)[valid]

    num_tokens_per_expert = torch.zeros(num_experts, dtype=torch.int64)
    num_tokens_per_expert.scatter_add_(0, experts, torch.ones_like(experts))

    # Setting a flag twice is idempotent, which is exactly the per-token deduplication the kernel must do.
    is_token_in_rank = torch.zeros(num_tokens, num_ranks, dtype=torch.bool)
    is_token_in_rank[token_of_entry, experts // num_local_experts] = True
    num_tokens_per_rank = is_token_in_rank.sum(dim=0)

    num_tokens_per_rdma_rank = None
    if num_ranks > num_ranks_per_node:
        num_nodes = num_ranks // num_ranks_per_node
        is_token_in_node = is_token_in_rank.view(num_tokens, num_nodes, num_ranks_per_node).any(dim=2)
        num_tokens_per_rdma_rank = is_token_in_node.sum(dim=0).int()
    return num_tokens_per_rank.int(), num_tokens_per_rdma_rank, num_tokens_per_expert.int(), is_token_in_rank


def loop_layout(topk_idx: torch.Tensor, num_experts: int, num_ranks: int, num_ranks_per_node: int):
    """The definition, one token at a time; only for checking reference_layout on small inputs."""
    num_local_experts = num_experts // num_ranks
    per_rank, per_expert = [0] * num_ranks, [0] * num_experts
    spans_nodes = num_ranks > num_ranks_per_node
    per_node = [0] * (num_ranks // num_ranks_per_node if spans_nodes else 0)
    in_rank = []
    for row in topk_idx.tolist():
        ranks = {e // num_local_experts for e in row if 0 <= e < num_experts}
        for e in row:
            if 0 <= e < num_experts:
                per_expert[e] += 1
        for r in ranks:
            per_rank[r] += 1
        for n in {r // num_ranks_per_node for r in ranks} if spans_nodes else ():
            per_node[n] += 1
        in_rank.append([r in ranks for r in range(num_ranks)])
    rdma = torch.tensor(per_node, dtype=torch.int32) if spans_nodes else None
    is_token_in_rank = torch.tensor(in_rank, dtype=torch.bool).reshape(len(in_rank), num_ranks)
    return (
        torch.tensor(per_rank, dtype=torch.int32),
        rdma,
        torch.tensor(per_expert, dtype=torch.int32),
        is_token_in_rank,
    )


def make_topk_idx(
    num_tokens: int,
    num_topk: int,
    num_experts: int,
    num_ranks: int,
    seed: int,
    invalid_fraction: float = 0.2,
    device: str = "cuda",
) -> torch.Tensor:
    """Distinct experts per token, skewed: a quarter of the tokens favour one rank (all their experts on it when it has
    enough), a few experts are popular overall, and ~invalid_fraction of the entries are -1."""
    generator = torch.Generator().manual_seed(seed)
    num_local_experts = num_experts // num_ranks
    scores = torch.rand(num_tokens, num_experts, generator=generator)
    hot_experts = torch.arange(num_experts) < max(1, num_experts // 16)
    scores += 0.3 * hot_experts.float()
    favours_one_rank = torch.rand(num_tokens, generator=generator) < 0.25
    favoured_rank = torch.randint(0, num_ranks, (num_tokens,), generator=generator)
    on_favoured_rank = (torch.arange(num_experts) // num_local_experts).unsqueeze(0) == favoured_rank.unsqueeze(1)
    scores += 2.0 * (on_favoured_rank & favours_one_rank.unsqueeze(1)).float()
    # Sorting random scores samples without replacement, so a token never repeats an expert.
    topk_idx = scores.argsort(dim=1, descending=True)[:, :num_topk].contiguous()
    topk_idx[torch.rand(num_tokens, num_topk, generator=generator) < invalid_fraction] = -1
    return topk_idx.to(device)


def assert_layout_equal(actual, expected, num_tokens: int, num_ranks: int, num_experts: int) -> None:
    num_tokens_per_rank, num_tokens_per_rdma_rank, num_tokens_per_expert, is_token_in_rank = actual
    ref_per_rank, ref_per_rdma_rank, ref_per_expert, ref_in_rank = expected
    assert num_tokens_per_rank.dtype == torch.int32 and num_tokens_per_rank.shape == (num_ranks,)
    assert num_tokens_per_expert.dtype == torch.int32 and num_tokens_per_expert.shape == (num_experts,)
    assert is_token_in_rank.dtype == torch.bool and is_token_in_rank.shape == (num_tokens, num_ranks)
    for tensor in (num_tokens_per_rank, num_tokens_per_expert, is_token_in_rank):
        assert tensor.is_cuda and tensor.is_contiguous()
    # Integer counts and flags: the semantics are deterministic, so equality is exact (no tolerance).
    assert torch.equal(num_tokens_per_rank.cpu(), ref_per_rank)
    assert torch.equal(num_tokens_per_expert.cpu(), ref_per_expert)
    assert torch.equal(is_token_in_rank.cpu(), ref_in_rank)
    if ref_per_rdma_rank is None:
        assert num_tokens_per_rdma_rank is None
    else:
        assert num_tokens_per_rdma_rank is not None
        assert num_tokens_per_rdma_rank.dtype == torch.int32 and num_tokens_per_rdma_rank.is_cuda
        assert torch.equal(num_tokens_per_rdma_rank.cpu(), ref_per_rdma_rank)


# (num_tokens, num_topk, num_experts, num_ranks, num_ranks_per_node, invalid_fraction); the seed is the case index.
CASES = [
    (0, 4, 64, 8, NUM_RANKS_PER_NODE, 0.2),
    (0, 8, 256, 16, NUM_RANKS_PER_NODE, 0.2),
    (1, 1, 8, 1, NUM_RANKS_PER_NODE, 0.0),
    (1, 9, 64, 16, NUM_RANKS_PER_NODE, 0.2),
    (1, 9, 1024, 32, NUM_RANKS_PER_NODE, 0.0),
    (7, 3, 8, 2, NUM_RANKS_PER_NODE, 0.2),
    (7, 8, 8, 4, NUM_RANKS_PER_NODE, 0.2),  # every expert chosen by every token (before the -1s)
    (7, 5, 64, 32, NUM_RANKS_PER_NODE, 0.2),
    (300, 1, 8, 8, NUM_RANKS_PER_NODE, 0.2),
    (300, 2, 64, 4, NUM_RANKS_PER_NODE, 0.2),
    (300, 6, 256, 32, NUM_RANKS_PER_NODE, 0.2),
    (300, 9, 1024, 16, NUM_RANKS_PER_NODE, 0.2),
    (300, 4, 64, 1, NUM_RANKS_PER_NODE, 0.2),
    (300, 8, 64, 8, NUM_RANKS_PER_NODE, 1.0),  # all -1: zero counts, all-false rows
    (4096, 8, 256, 8, NUM_RANKS_PER_NODE, 0.0),  # the design's prefill shape
    (4096, 8, 256, 8, NUM_RANKS_PER_NODE, 0.2),
    (4096, 8, 256, 16, NUM_RANKS_PER_NODE, 0.2),
    (4096, 9, 1024, 32, NUM_RANKS_PER_NODE, 0.2),
    (4096, 7, 1024, 2, NUM_RANKS_PER_NODE, 0.2),
    (4096, 1, 8, 8, NUM_RANKS_PER_NODE, 0.2),
    (4096, 5, 64, 32, NUM_RANKS_PER_NODE, 0.2),
    (4096, 3, 8, 1, NUM_RANKS_PER_NODE, 0.2),
    (4096, 8, 256, 8, 4, 0.2),  # two nodes of four ranks
    (4096, 6, 64, 16, 2, 0.2),  # eight nodes of two ranks
    # Beyond the shared-memory counters (48 KiB, ~12k counters): the global-atomics path of the kernel.
    (4096, 8, 16384, 16, NUM_RANKS_PER_NODE, 0.2),
    (300, 9, 32768, 32, NUM_RANKS_PER_NODE, 0.2),
    # The owner kernel's scope (taken only with EP_DISPATCHER_PENDING_KERNELS=1: run_device.sh's `pending` phase reruns
    # this file so): num_tokens * max(num_topk, 1) <= 65536, num_topk <= 16, <= 64 ranks and nodes, counters <= 12288.
    # Each boundary once inside, once outside (the fallback); without the switch all of them take the fallback.
    (8192, 8, 256, 8, NUM_RANKS_PER_NODE, 0.2),  # exactly 65536 entries
    (8193, 8, 256, 8, NUM_RANKS_PER_NODE, 0.2),  # 65544: fallback
    (65536, 1, 256, 8, NUM_RANKS_PER_NODE, 0.2),
    (65537, 1, 256, 8, NUM_RANKS_PER_NODE, 0.2),  # fallback
    (6000, 0, 256, 8, NUM_RANKS_PER_NODE, 0.0),  # top-0: zero counts, all-false rows
    (2048, 8, 256, 64, NUM_RANKS_PER_NODE, 0.2),  # 64 ranks in 8 nodes: the masks' last bit
    (1000, 8, 256, 128, NUM_RANKS_PER_NODE, 0.2),  # 128 ranks: fallback
    (1000, 4, 64, 64, 1, 0.2),  # 64 nodes of one rank
    (600, 8, 512, 64, 4, 0.2),  # blocks that own 40 ranks: ballot counts past lane 31
    (1500, 16, 256, 32, NUM_RANKS_PER_NODE, 0.2),  # top-16
    (1500, 17, 256, 32, NUM_RANKS_PER_NODE, 0.2),  # top-17: fallback
    (64, 8, 12224, 64, 64, 0.2),  # 12288 counters: the shared-memory limit, one node
    (64, 8, 12288, 64, 64, 0.2),  # 12352 counters: fallback
    (0, 8, 256, 8, NUM_RANKS_PER_NODE, 0.2),  # no tokens: every counter still stored (as zero)
    (5, 8, 256, 8, NUM_RANKS_PER_NODE, 0.2),  # fewer tokens than blocks: empty token slices
    (33, 8, 256, 16, NUM_RANKS_PER_NODE, 0.2),  # a second, partial warp
    (1025, 8, 256, 8, NUM_RANKS_PER_NODE, 0.2),  # a second step of the 1024-thread blocks
    (512, 8, 240, 6, NUM_RANKS_PER_NODE, 0.2),  # rows of 6 flags: 2-byte stores
    (515, 5, 63, 7, NUM_RANKS_PER_NODE, 0.2),  # rows of 7 flags: byte stores
]


def _case_id(case) -> str:
    num_tokens, num_topk, num_experts, num_ranks, num_ranks_per_node, invalid = case
    return f"N{num_tokens}-k{num_topk}-E{num_experts}-R{num_ranks}-P{num_ranks_per_node}-inv{invalid}"


def test_reference_matches_loop_definition():
    for seed, (num_tokens, num_topk, num_experts, num_ranks) in enumerate(
        [(0, 3, 8, 2), (1, 2, 8, 8), (9, 3, 16, 16), (33, 5, 64, 32), (50, 8, 8, 4)]
    ):
        topk_idx = make_topk_idx(num_tokens, num_topk, num_experts, num_ranks, seed, device="cpu")
        for actual, expected in zip(
            reference_layout(topk_idx, num_experts, num_ranks, NUM_RANKS_PER_NODE),
            loop_layout(topk_idx, num_experts, num_ranks, NUM_RANKS_PER_NODE),
        ):
            assert (actual is None) == (expected is None)
            if actual is not None:
                assert torch.equal(actual, expected)


@pytest.mark.parametrize("case_index", range(len(CASES)), ids=[_case_id(c) for c in CASES])
def test_layout_matches_reference(case_index: int):
    num_tokens, num_topk, num_experts, num_ranks, num_ranks_per_node, invalid = CASES[case_index]
    topk_idx = make_topk_idx(num_tokens, num_topk, num_experts, num_ranks, seed=case_index, invalid_fraction=invalid)
    actual = _C.get_dispatch_layout(topk_idx, num_experts, num_ranks, num_ranks_per_node)
    expected = reference_layout(topk_idx, num_experts, num_ranks, num_ranks_per_node)
    assert_layout_equal(actual, expected, num_tokens, num_ranks, num_experts)


def test_out_of_range_expert_ids_are_ignored():
    # Documented choice: ids outside [0, num_experts) are skipped like -1 (the host cannot check them without a sync).
    topk_idx = make_topk_idx(300, 6, 64, 8, seed=101)
    topk_idx[::7, 0] = 64
    topk_idx[::5, 1] = -3
    actual = _C.get_dispatch_layout(topk_idx, 64, 8, NUM_RANKS_PER_NODE)
    assert_layout_equal(actual, reference_layout(topk_idx, 64, 8, NUM_RANKS_PER_NODE), 300, 8, 64)


@pytest.mark.parametrize(
    "num_tokens,num_topk,num_experts,num_ranks,num_ranks_per_node",
    [(4096, 8, 256, 8, 8), (8193, 8, 256, 8, 8), (1000, 8, 256, 16, 8), (300, 6, 64, 64, 1), (515, 5, 63, 7, 8)],
)
def test_duplicate_and_wild_expert_ids(
    num_tokens: int, num_topk: int, num_experts: int, num_ranks: int, num_ranks_per_node: int
):
    # A repeated expert counts twice for the expert and once for its rank and node. Ids outside [0, num_experts) are
    # ignored, including those whose low 32 bits are a valid expert (2^32 + 3), whatever the path (these shapes span
    # both of them under EP_DISPATCHER_PENDING_KERNELS=1).
    generator = torch.Generator().manual_seed(601)
    topk_idx = make_topk_idx(num_tokens, num_topk, num_experts, num_ranks, seed=602, device="cpu")
    repeated = torch.rand(num_tokens, generator=generator) < 0.2
    topk_idx[repeated, 1] = topk_idx[repeated, 0]
    wild = torch.tensor([num_experts, num_experts + 7, -5, 2**32 + 3, 2**31, 2**62, -(2**63)])
    picked = torch.rand(topk_idx.shape, generator=generator) < 0.05
    topk_idx[picked] = wild[torch.randint(0, len(wild), (int(picked.sum()),), generator=generator)]
    actual = _C.get_dispatch_layout(topk_idx.cuda(), num_experts, num_ranks, num_ranks_per_node)
    expected = reference_layout(topk_idx, num_experts, num_ranks, num_ranks_per_node)
    assert_layout_equal(actual, expected, num_tokens, num_ranks, num_experts)


@pytest.mark.parametrize(
    "num_tokens,num_topk,num_experts,num_ranks",
    [(4096, 8, 256, 16), (300, 9, 1024, 32), (7, 3, 8, 2), (4096, 8, 256, 8), (5, 8, 256, 8), (0, 8, 256, 8)],
)
def test_outputs_do_not_depend_on_stale_memory(num_tokens: int, num_topk: int, num_experts: int, num_ranks: int):
    # Run 1 leaves its outputs (other counts, other flags) in the allocator; run 2's outputs are likely the same blocks.
    first = make_topk_idx(num_tokens, num_topk, num_experts, num_ranks, seed=201, invalid_fraction=0.0)
    outputs = _C.get_dispatch_layout(first, num_experts, num_ranks, NUM_RANKS_PER_NODE)
    torch.cuda.synchronize()
    del outputs
    second = make_topk_idx(num_tokens, num_topk, num_experts, num_ranks, seed=202, invalid_fraction=0.5)
    actual = _C.get_dispatch_layout(second, num_experts, num_ranks, NUM_RANKS_PER_NODE)
    expected = reference_layout(second, num_experts, num_ranks, NUM_RANKS_PER_NODE)
    assert_layout_equal(actual, expected, num_tokens, num_ranks, num_experts)
    del actual

    # Blocks explicitly filled with 0x5A (counts 0x5A5A5A5A, flags "true" in every byte); the outputs are views of one
    # allocation of the counters' and the flags' bytes together.
    for num_bytes in (num_tokens * num_ranks + 4 * (num_experts + num_ranks), num_tokens * num_ranks, 4 * num_experts):
        poison_allocator(max(num_bytes, 1), count=4, value=0x5A)
    actual = _C.get_dispatch_layout(second, num_experts, num_ranks, NUM_RANKS_PER_NODE)
    assert_layout_equal(actual, expected, num_tokens, num_ranks, num_experts)


@pytest.mark.parametrize("num_ranks,num_experts", [(1, 256), (2, 256), (8, 256), (3, 12)])
def test_is_token_in_rank_starts_16_byte_aligned(num_ranks: int, num_experts: int):
    # The dispatch's send-position scan reads is_token_in_rank in 16-byte vectors only from an aligned start (else
    # byte loads: 27 us instead of ~5 at EP = 1, 65536 tokens); the counters before it in the one allocation end at
    # 4 * (ranks + experts) bytes, which is 1028 at 1 rank x 256 experts.
    topk_idx = make_topk_idx(64, 2, num_experts, num_ranks, seed=501)
    actual = _C.get_dispatch_layout(topk_idx, num_experts, num_ranks, NUM_RANKS_PER_NODE)
    assert actual[3].data_ptr() % 16 == 0
    assert_layout_equal(
        actual, reference_layout(topk_idx, num_experts, num_ranks, NUM_RANKS_PER_NODE), 64, num_ranks, num_experts
    )


def test_runs_on_the_current_stream():
    topk_idx = make_topk_idx(4096, 8, 256, 16, seed=301)
    side_stream = torch.cuda.Stream()
    side_stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side_stream):
        actual = _C.get_dispatch_layout(topk_idx, 256, 16, NUM_RANKS_PER_NODE)
    side_stream.synchronize()
    assert_layout_equal(actual, reference_layout(topk_idx, 256, 16, NUM_RANKS_PER_NODE), 4096, 16, 256)


@pytest.mark.parametrize("num_tokens,num_ranks", [(4096, 8), (8193, 8), (1000, 128)])
def test_launches_per_call(num_tokens: int, num_ranks: int):
    """Pins what one call puts on the stream, so that a path silently not taken fails here: within the owner kernel's
    scope and with EP_DISPATCHER_PENDING_KERNELS=1, that kernel alone (no memset); otherwise the memset and the
    fallback kernel."""
    topk_idx = make_topk_idx(num_tokens, 8, 256, num_ranks, seed=451)
    _C.get_dispatch_layout(topk_idx, 256, num_ranks, NUM_RANKS_PER_NODE)  # warm: lazy initialisation stays out
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        _C.get_dispatch_layout(topk_idx, 256, num_ranks, NUM_RANKS_PER_NODE)
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    kernels = sorted(
        name for kernel in ("owner_layout_kernel", "get_dispatch_layout_kernel") for name in names if kernel in name
    )
    memsets = [name for name in names if "memset" in name.lower()]
    owner = _C.pending_kernels_enabled() and num_tokens * 8 <= 65536 and num_ranks <= 64
    if owner:
        assert len(kernels) == 1 and "owner_layout_kernel" in kernels[0] and not memsets, names
    else:
        # The profiler's memset records ("Memset (Device)") are not what this pins: at most the one.
        assert len(kernels) == 1 and "get_dispatch_layout_kernel" in kernels[0] and len(memsets) <= 1, names


def test_cuda_graph_capture_and_replay():
    num_tokens, num_topk, num_experts, num_ranks = 4096, 8, 256, 16
    static_topk_idx = make_topk_idx(num_tokens, num_topk, num_experts, num_ranks, seed=401)
    side_stream = torch.cuda.Stream()
    # Warm up on the capture stream first, as torch recommends (lazy initialisation must not happen in capture).
    side_stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side_stream):
        _C.get_dispatch_layout(static_topk_idx, num_experts, num_ranks, NUM_RANKS_PER_NODE)
    torch.cuda.current_stream().wait_stream(side_stream)
    torch.cuda.synchronize()

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side_stream):
        captured = _C.get_dispatch_layout(static_topk_idx, num_experts, num_ranks, NUM_RANKS_PER_NODE)

    for seed in (402, 403):
        new_topk_idx = make_topk_idx(num_tokens, num_topk, num_experts, num_ranks, seed=seed)
        static_topk_idx.copy_(new_topk_idx)
        graph.replay()
        torch.cuda.synchronize()
        eager = _C.get_dispatch_layout(new_topk_idx, num_experts, num_ranks, NUM_RANKS_PER_NODE)
        for replayed, direct in zip(captured, eager):
            assert torch.equal(replayed, direct)
        expected = reference_layout(new_topk_idx, num_experts, num_ranks, NUM_RANKS_PER_NODE)
        assert_layout_equal(captured, expected, num_tokens, num_ranks, num_experts)


def _good_topk_idx() -> torch.Tensor:
    return make_topk_idx(16, 4, 64, 8, seed=501)


@pytest.mark.parametrize(
    "make_args,message",
    [
        (lambda: (_good_topk_idx().int(), 64, 8, 8), r"topk_idx must have dtype torch\.int64"),
        (lambda: (_good_topk_idx().t().contiguous().t(), 64, 8, 8), r"topk_idx must be contiguous"),
        (lambda: (_good_topk_idx().flatten(), 64, 8, 8), r"topk_idx must be 2-D"),
        (lambda: (_good_topk_idx().unsqueeze(0), 64, 8, 8), r"topk_idx must be 2-D"),
        (lambda: (_good_topk_idx().cpu(), 64, 8, 8), r"topk_idx must be a CUDA tensor"),
        (lambda: (_good_topk_idx(), 60, 8, 8), r"num_experts must be a multiple of num_ranks=8, got 60"),
        (lambda: (_good_topk_idx(), 0, 8, 8), r"num_experts must be in \[1, 2\^31\), got 0"),
        (lambda: (_good_topk_idx(), 64, 0, 8), r"num_ranks must be in \[1, 2\^31\), got 0"),
        (lambda: (_good_topk_idx(), 96, 12, 8), r"num_ranks must be a multiple of num_ranks_per_node=8"),
        (lambda: (_good_topk_idx(), 64, 8, 0), r"num_ranks_per_node must be positive, got 0"),
    ],
    ids=[
        "dtype",
        "non-contiguous",
        "1-D",
        "3-D",
        "cpu",
        "experts-not-multiple",
        "no-experts",
        "no-ranks",
        "ranks-not-multiple-of-node",
        "no-ranks-per-node",
    ],
)
def test_bad_inputs_raise(make_args, message: str):
    with pytest.raises(ValueError, match=message) as error:
        _C.get_dispatch_layout(*make_args())
    assert str(error.value).startswith("get_dispatch_layout: ")
