"""Differentiable dispatch/combine: gradcheck (1 rank, fp64) and the adjoint identity across ranks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from ep_dispatcher import Buffer, Config
from ep_dispatcher import autograd as ep_autograd
from tests.dist import run

E, K, H = 8, 3, 16  # H=16 keeps fp64 rows a multiple of 16 bytes


def _buffer(world: int) -> Buffer:
    return Buffer(None, num_nvl_bytes=Config().get_nvl_buffer_size_hint(H * 8, world), backend="reference")


def _inputs(rank: int, seed: int, num_tokens: int):
    g = torch.Generator().manual_seed(seed * 100 + rank)
    x = torch.randn((num_tokens, H), generator=g, dtype=torch.float64)
    topk_idx = torch.rand((num_tokens, E), generator=g).argsort(1)[:, :K].contiguous()
    topk_idx[torch.rand((num_tokens, K), generator=g) < 0.2] = -1
    topk_weights = torch.rand((num_tokens, K), generator=g)
    return x, topk_idx, topk_weights


def _gradcheck_worker(rank: int, world: int) -> bool:
    buf = _buffer(world)
    x, topk_idx, topk_weights = _inputs(rank, 1, 5)
    g = torch.Generator().manual_seed(9)
    bias = torch.randn((5, H), generator=g, dtype=torch.float64)

    def layer(x_in, bias_in):
        recv_x, _, recv_w, _, handle = ep_autograd.dispatch(buf, x_in, topk_idx, topk_weights, E)
        y = recv_x * (1.0 + recv_w.sum(1, keepdim=True).double()) + recv_x**2
        return ep_autograd.combine(buf, y, handle, bias=bias_in)

    assert torch.autograd.gradcheck(layer, (x.requires_grad_(), bias.requires_grad_()), eps=1e-6, atol=1e-8)
    return True


def test_gradcheck_single_rank_fp64():
    assert run(_gradcheck_worker, 1) == [True]


def _adjoint_worker(rank: int, world: int, seed: int, num_worst_tokens: int) -> float:
    buf = _buffer(world)
    x, topk_idx, topk_weights = _inputs(rank, seed, 3 + 4 * rank)
    x.requires_grad_()
    topk_weights.requires_grad_()
    recv_x, recv_idx, recv_w, _, handle = ep_autograd.dispatch(
        buf, x, topk_idx, topk_weights, E, num_worst_tokens=num_worst_tokens
    )
    g = torch.Generator().manual_seed(seed * 7 + rank)
    cx = torch.randn(recv_x.shape, generator=g, dtype=torch.float64)
    cw = torch.randn(recv_w.shape, generator=g)
    ((recv_x * cx).sum() + (recv_w.double() * cw).sum()).backward()
    # <D(x), c> summed over ranks equals <x, D^T(c)> summed over ranks: backward is the exact adjoint.
    lhs = torch.stack([(recv_x.detach() * cx).sum(), (recv_w.detach().double() * cw).sum()])
    rhs = torch.stack([(x.detach() * x.grad).sum(), (topk_weights.detach().double() * topk_weights.grad).sum()])
    dist.all_reduce(lhs)
    dist.all_reduce(rhs)
    assert torch.allclose(lhs[0], rhs[0], rtol=1e-12), (lhs, rhs)  # fp64 payload
    assert torch.allclose(lhs[1], rhs[1], rtol=1e-5), (lhs, rhs)  # fp32 weights
    # Entries routed nowhere (-1) get no weight gradient.
    assert bool((topk_weights.grad[topk_idx < 0] == 0).all())

    # Combine's backward is a cached dispatch of the gradient.
    y = recv_x.detach().clone().requires_grad_()
    out = ep_autograd.combine(buf, y, handle)
    grad_out = torch.randn(out.shape, generator=g, dtype=torch.float64)
    out.backward(grad_out)
    expected, _, _, _, _, _ = buf.dispatch(grad_out, handle=handle)
    assert torch.equal(y.grad, expected)
    if num_worst_tokens:
        assert handle.num_recv_tokens == -1  # unknown on the host without a sync
        num_recv = int(handle.rank_prefix_matrix[-1, rank])
        assert bool((y.grad[num_recv:] == 0).all())

    # A weight output the loss ignores: no weight gradient, and the collectives still match on every rank.
    x2 = x.detach().clone().requires_grad_()
    w2 = topk_weights.detach().clone().requires_grad_()
    recv_x2, _, _, _, _ = ep_autograd.dispatch(buf, x2, topk_idx, w2, E)
    recv_x2.sum().backward()
    assert w2.grad is None and x2.grad is not None
    return float(lhs[0])


@pytest.mark.parametrize("world, num_worst_tokens", [(2, 0), (4, 0), (4, 64)])
def test_backward_is_adjoint(world, num_worst_tokens):
    run(_adjoint_worker, world, 3, num_worst_tokens)
