"""examples/megatron_pretrain_moe.py runs end to end on CPU (2 gloo ranks) and "deepep" matches "allgather"."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

try:
    import megatron.core  # noqa: F401

    MEGATRON_SKIP_REASON = None
except Exception as e:  # noqa: BLE001  (ImportError, or a broken dependency such as triton raising anything)
    MEGATRON_SKIP_REASON = f"megatron-core is not importable: {type(e).__name__}: {e}"

EXAMPLE = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "megatron_pretrain_moe.py"
)


# A tiny model, 3 steps on 2 gloo ranks: a few seconds on CPU.
SMALL_RUN = "--ranks 2 --steps 3 --layers 1 --hidden 32 --experts 4 --seq 16 --vocab 64 --backend gloo".split()


def _run_example(*extra: str) -> tuple[str, list]:
    """Run the example on CPU; its stdout and its loss table's rows (step, first loss, second loss, difference)."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    command = [sys.executable, EXAMPLE, *SMALL_RUN, *extra]
    done = subprocess.run(command, check=False, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = re.findall(r"^\s*(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.e+-]+)$", done.stdout, flags=re.MULTILINE)
    assert [int(r[0]) for r in rows] == [0, 1, 2], done.stdout
    return done.stdout, rows


@pytest.mark.skipif(MEGATRON_SKIP_REASON is not None, reason=MEGATRON_SKIP_REASON or "")
def test_example_trains_and_matches_allgather():
    stdout, rows = _run_example()
    for _, deepep, allgather, _ in rows:
        assert abs(float(deepep) - float(allgather)) <= 1e-5  # fp32; the example's own tolerance
    assert "OK" in stdout


@pytest.mark.skipif(MEGATRON_SKIP_REASON is not None, reason=MEGATRON_SKIP_REASON or "")
def test_example_flex_switch_matches_the_plugin():
    """Issue 20: Megatron's own flex dispatcher on ep_dispatcher through install_as_deep_ep() alone trains like our
    plugin's path (same losses, fp32)."""
    stdout, rows = _run_example("--flex-switch")
    assert "flex(switch)" in stdout, stdout
    for _, ours, flex, _ in rows:
        assert abs(float(ours) - float(flex)) <= 1e-5


@pytest.mark.skipif(MEGATRON_SKIP_REASON is not None, reason=MEGATRON_SKIP_REASON or "")
def test_example_grouped_experts_train_and_match_allgather():
    """--expert-impl grouped (examples/torch_grouped_experts.py, the benchmark's experts) in a Megatron GPTModel:
    both dispatchers train alike, and the losses differ from SequentialMLP's (the spec swap took effect)."""
    _, sequential = _run_example()
    stdout, grouped = _run_example("--expert-impl", "grouped")
    assert "OK" in stdout
    for _, deepep, allgather, _ in grouped:
        assert abs(float(deepep) - float(allgather)) <= 1e-5
    assert any(abs(float(s[1]) - float(g[1])) > 1e-4 for s, g in zip(sequential, grouped))


def test_grouped_experts_match_a_loop_over_experts():
    """The grouped experts against one GEMM pair per expert, forward and every gradient, with empty experts and
    counts that are not multiples of the row alignment (bit-exact on CPU, where both run the same GEMMs)."""
    import types

    import torch

    sys.path.insert(0, os.path.dirname(EXAMPLE))
    try:
        from torch_grouped_experts import TorchGroupedMLP
    finally:
        sys.path.pop(0)

    torch.manual_seed(3)
    config = types.SimpleNamespace(
        gated_linear_unit=False,
        add_bias_linear=False,
        moe_ffn_hidden_size=24,
        hidden_size=16,
        init_method_std=0.5,
        activation_func=torch.nn.functional.gelu,
    )
    experts = TorchGroupedMLP(5, config).to(torch.bfloat16)
    counts = torch.tensor([5, 0, 11, 3, 0])
    x = torch.randn(int(counts.sum()), 16, dtype=torch.bfloat16, requires_grad=True)
    probs = torch.rand(x.shape[0], requires_grad=True)
    out, bias = experts(x, counts, probs)
    assert bias is None
    grad = torch.randn_like(out)
    out.backward(grad)

    leaves = [t.detach().clone().requires_grad_() for t in (x, probs, experts.fc1_weight, experts.fc2_weight)]
    rx, rprobs, w1, w2 = leaves
    pieces, start = [], 0
    for e, count in enumerate(counts.tolist()):
        rows = slice(start, start + count)
        hidden = torch.nn.functional.gelu(rx[rows] @ w1[e].T) * rprobs[rows, None]
        pieces.append(hidden.to(torch.bfloat16) @ w2[e].T)
        start += count
    expected = torch.cat(pieces)
    expected.backward(grad)
    assert torch.equal(out, expected)
    for got, want in zip((x.grad, probs.grad, experts.fc1_weight.grad, experts.fc2_weight.grad), leaves):
        assert torch.equal(got, want.grad)
    assert experts.fc1_weight.allreduce is False and experts.fc2_weight.allreduce is False


@pytest.mark.skipif(MEGATRON_SKIP_REASON is not None, reason=MEGATRON_SKIP_REASON or "")
def test_example_kv_channels_narrow_the_attention():
    """--kv-channels (the step benchmark's MoE-dominated shape narrows the attention with it): both dispatchers still
    train alike, and the losses differ from the default width's (the option reached Megatron's config)."""
    _, default = _run_example()
    stdout, narrow = _run_example("--kv-channels", "4")  # SMALL_RUN's default: hidden 32 / 4 heads = 8
    assert "OK" in stdout
    for _, deepep, allgather, _ in narrow:
        assert abs(float(deepep) - float(allgather)) <= 1e-5
    assert any(abs(float(d[1]) - float(n[1])) > 1e-4 for d, n in zip(default, narrow))
