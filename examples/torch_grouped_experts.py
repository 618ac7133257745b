"""A Megatron-core experts module on ``torch._grouped_mm``: every local expert's FFN in two grouped GEMMs, with no
host sync and no per-expert launch (the examples' and benchmarks' ``--expert-impl grouped``).

Why: Megatron's GPU grouped experts (``TEGroupedMLP``) need TransformerEngine, which this project does not rely on.
Its fallback, ``SequentialMLP``, reads the token counts on the host and launches a GEMM per local expert, so a step
becomes host-bound and the ranks drift apart by milliseconds. That drift then lands in the first collective after
the expert loop (the forward combine) and hides the dispatcher's own cost. This module keeps the expert compute on
the GPU, as a pretraining run with grouped GEMM does.

Same maths as ``SequentialMLP`` over Megatron's ``MLP`` with ``add_bias_linear=False`` and no gated linear unit:
``fc2(act(fc1(x)) * prob)`` per token, with the token's local expert's weights. Each expert's rows are moved to a
start aligned to 8 rows (16 bytes of bf16 for the weight-gradient GEMM, which groups along the token dimension),
with device-side index arithmetic only (rows past the last group are zeros and never read back).
"""

from __future__ import annotations

import torch

ROW_ALIGN = 8  # rows per alignment unit of a group's start (16 bytes of bf16)


class TorchGroupedMLP(torch.nn.Module):
    """Drop-in for ``SequentialMLP`` in a Megatron MoE layer spec (``ModuleSpec(module=TorchGroupedMLP)``)."""

    def __init__(self, num_local_experts: int, config, **_) -> None:  # submodules, pg_collection, name: unused
        super().__init__()
        if config.gated_linear_unit or config.add_bias_linear:
            raise ValueError("TorchGroupedMLP: expected gated_linear_unit=False and add_bias_linear=False")
        self.config = config
        self.num_local_experts = num_local_experts
        ffn = config.moe_ffn_hidden_size
        # [E, out, in] like nn.Linear; the GEMMs take the transposed (column-major) view.
        self.fc1_weight = torch.nn.Parameter(torch.empty(num_local_experts, ffn, config.hidden_size))
        self.fc2_weight = torch.nn.Parameter(torch.empty(num_local_experts, config.hidden_size, ffn))
        for weight in (self.fc1_weight, self.fc2_weight):
            torch.nn.init.normal_(weight, std=config.init_method_std)
            weight.allreduce = False  # an expert parameter: averaged over the expert-data-parallel group only

    def _aligned_rows(self, tokens_per_expert: torch.Tensor, num_rows: int):
        """Each row's place in the aligned layout, and the groups' aligned end offsets (int32), on the device."""
        counts = tokens_per_expert.to(device=self.fc1_weight.device, dtype=torch.int64, non_blocking=True)
        aligned_counts = (counts + ROW_ALIGN - 1) // ROW_ALIGN * ROW_ALIGN
        ends, aligned_ends = torch.cumsum(counts, 0), torch.cumsum(aligned_counts, 0)
        rows = torch.arange(num_rows, device=counts.device)
        group = torch.searchsorted(ends, rows, right=True)  # the row's expert (empty experts are skipped)
        place = rows + (aligned_ends - aligned_counts - ends + counts)[group]
        return place, aligned_ends.to(torch.int32)

    def forward(self, hidden: torch.Tensor, tokens_per_expert: torch.Tensor, probs: torch.Tensor, **_):
        place, offsets = self._aligned_rows(tokens_per_expert, hidden.shape[0])
        padded_rows = hidden.shape[0] + self.num_local_experts * (ROW_ALIGN - 1)  # a bound: no host sync
        aligned = hidden.new_zeros(padded_rows, hidden.shape[1]).index_copy(0, place, hidden)
        aligned_probs = probs.new_zeros(padded_rows).index_copy(0, place, probs)
        intermediate = torch._grouped_mm(aligned, self.fc1_weight.transpose(-2, -1), offs=offsets)
        intermediate = self.config.activation_func(intermediate) * aligned_probs.unsqueeze(-1)
        output = torch._grouped_mm(intermediate.to(hidden.dtype), self.fc2_weight.transpose(-2, -1), offs=offsets)
        return output[place], None

    def backward_dw(self) -> None:  # Megatron's delayed weight-gradient hook: gradients are computed in backward
        pass
