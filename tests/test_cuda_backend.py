"""Host-side pieces of the CUDA backend that run without a GPU: the internode send positions."""

from __future__ import annotations

import pytest
import torch

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
