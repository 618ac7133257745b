"""examples/deepspeed_moe.py runs end to end on CPU and our losses equal DeepSpeed's."""

from __future__ import annotations

import importlib
import os
import sys

import pytest

pytest.importorskip("deepspeed", reason="DeepSpeed not installed: the DeepSpeed-MoE example is not run")

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")


def test_example_runs_small_on_cpu(capsys):
    # Importable by name (sys.path travels to the spawned ranks), so the ranks can unpickle its train().
    if EXAMPLES not in sys.path:
        sys.path.insert(0, EXAMPLES)
    example = importlib.import_module("deepspeed_moe")
    max_diff = example.main(["--ranks", "2", "--steps", "3", "--layers", "1", "--hidden", "16", "--backend", "gloo"])
    out = capsys.readouterr().out
    assert "max |diff|" in out and out.count("\n") >= 6, out
    assert max_diff < 1e-5  # fp32 losses after 3 AdamW steps
