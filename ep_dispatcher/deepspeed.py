"""Drop-in for DeepSpeed-MoE: ``deepspeed.moe.layer.MoE`` routed by DeepSpeed's gate, moved by our dispatch/combine.

Switch a model by changing one line::

    from ep_dispatcher.deepspeed import MoE      # was: from deepspeed.moe.layer import MoE

or convert a built model in place with ``patch(model)`` (and back with ``unpatch(model)``).

What stays DeepSpeed's (so checkpoints, ``deepspeed.initialize`` and expert-gradient handling see no difference):
the ``MoE`` class (ours subclasses it), its ``TopKGate`` and ``Experts`` modules, every parameter name,
``state_dict`` key and the expert parameter attributes ``allreduce=False`` / ``group_name``, and
``set_deepspeed_parallelism()``. What changes: the inner ``MOELayer`` becomes :class:`EPMOELayer`, a subclass whose
``forward`` replaces the capacity-padded ``[experts, capacity, hidden]`` buffers and the two all-to-alls by
``ep_dispatcher.autograd.dispatch`` / ``combine``: only routed tokens move, each rank runs every local expert on
its contiguous rows, and the outputs come back to their tokens.

Routing is exactly DeepSpeed's: the layer calls the gate the same way DeepSpeed's ``MOELayer`` does (its sparse-route
outputs: per route the expert id, ``-1`` where the capacity limit dropped it, and the normalised gate weight), so
top-k choices, capacity drops, RTS, noisy gating, 2nd-expert sampling, ``l_aux`` and ``exp_counts`` are the same for
the same RNG state. Gate weights are applied on the expert side (each expert row is scaled by its received weight
before the unweighted combine), so the weight gradient flows back through dispatch's backward to the gate, as in
DeepSpeed. With ``EPMOELayer.fused_permute = False`` the received rows are permuted expert-major in a separate pass,
each local expert runs once on its contiguous rows, and per token the weighted outputs of the experts of one rank are
summed in top-k order, then the ranks' sums in rank order (fp32 for fp32 data), which equals DeepSpeed's route sum up
to fp32 rounding. ``EPMOELayer.fused_permute = True`` (the default) receives tokens straight into expert-major rows
(the fused permute, ``Buffer.dispatch(..., expert_major=True)``) and the combine reads the weighted rows (rounded to
the data dtype) where they are, summing a token's rows in local-expert order (fp32, one rounding);
``fixed_order_unpermute = True`` (unfused) runs that same arithmetic as separate passes, bit-identical to the fused
path (``docs/fused_permute.md``).

Not supported (a clear error instead): ``use_tutel=True``; ``enable_expert_tensor_parallelism=True``; a tensor-parallel
non-expert part (``groups.mpu`` with tensor-parallel size > 1), where DeepSpeed drops and re-gathers duplicate tokens.
"""

from __future__ import annotations

from typing import Any, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

try:
    from deepspeed.moe import sharded_moe as _ds_sharded_moe
    from deepspeed.moe.layer import MoE as _DeepSpeedMoE
    from deepspeed.moe.sharded_moe import MOELayer as _DeepSpeedMOELayer
    from deepspeed.utils import groups as _ds_groups
    from deepspeed.utils.bwc import bwc_tensor_model_parallel_world_size
except ImportError as e:  # pragma: no cover - exercised only without deepspeed
    raise ImportError(f"ep_dispatcher.deepspeed needs DeepSpeed (pip install deepspeed): {e}") from e

from . import autograd as ep_autograd
from .buffer_cache import BufferCache
from .expert_major import expert_major_layout, permute, permute_probs, unpermute

__all__ = ["EPMOELayer", "MoE", "clear_buffers", "patch", "set_backend", "unpatch"]

_buffers = BufferCache("EP_DISPATCHER_DEEPSPEED_BACKEND")  # one Buffer per EP group; env: "auto" | "cuda" | "reference"


def set_backend(backend: Optional[str]) -> None:
    """Backend of buffers created from now on (``None`` = env ``EP_DISPATCHER_DEEPSPEED_BACKEND`` or ``"auto"``)."""
    _buffers.backend_override = backend


def clear_buffers() -> None:
    """Forget the cached buffers (e.g. before destroying the process groups)."""
    _buffers.clear()


def _expert_output(expert: nn.Module, rows: torch.Tensor) -> torch.Tensor:
    out = expert(rows)
    return out[0] if isinstance(out, tuple) else out  # like DeepSpeed's Experts: ignore a returned bias


class EPMOELayer(_DeepSpeedMOELayer):
    """DeepSpeed's ``MOELayer`` with the dispatch path replaced (same attributes, parameters and ``state_dict``).

    ``forward(hidden_states [..., hidden], used_token [num_tokens] | None) -> output [..., hidden]`` (dtype of the
    input); sets ``self.l_aux`` (scalar fp32) and ``self.exp_counts`` ([num_experts] int64), as DeepSpeed's does.
    Instances are made by :class:`MoE` or by :func:`patch` (which changes the class of an existing layer).

    Class attributes: ``fused_permute`` (default True): receive into expert-major rows and combine from them.
    Unfused, ``fixed_order_unpermute`` (default False) picks the separate passes: False, the original expert-side sum
    (fp32 weighted outputs summed in top-k order); True, ``ep_dispatcher.expert_major.permute`` / ``unpermute`` with
    the fused path's arithmetic (bit-identical to it in outputs and gradients).
    """

    fused_permute: bool = True
    fixed_order_unpermute: bool = False

    def _check_supported(self) -> None:
        if self.use_tutel:
            raise NotImplementedError(
                "ep_dispatcher.deepspeed: use_tutel=True is not supported (Tutel has its own "
                "dispatch); build the layer with use_tutel=False"
            )
        tp = bwc_tensor_model_parallel_world_size(_ds_groups.mpu)
        if tp > 1:
            raise NotImplementedError(
                f"ep_dispatcher.deepspeed: a tensor-parallel model (tensor-parallel size {tp}) "
                "is not supported; DeepSpeed's duplicate-token drop/gather across TP ranks is "
                "not implemented here"
            )
        if self.ep_size > 1 and self.ep_group is None:
            raise RuntimeError(
                f"ep_dispatcher.deepspeed: ep_size={self.ep_size} but the layer has no expert-parallel "
                "group; call set_deepspeed_parallelism() on the MoE module (deepspeed.initialize does)"
            )
        if self.ep_group is not None and dist.get_world_size(self.ep_group) != self.ep_size:
            raise ValueError(
                f"ep_group: has {dist.get_world_size(self.ep_group)} ranks, expected ep_size={self.ep_size}"
            )

    def _run_local_experts(
        self, recv_x: torch.Tensor, recv_topk_idx: torch.Tensor, recv_topk_weights: torch.Tensor, counts: List[int]
    ) -> torch.Tensor:
        """Expert-side compute: ``[num_recv_rows, hidden]`` -> weighted per-row sums ``[num_recv_rows, hidden]``.

        Every (row, top-k slot) naming a local expert is listed expert-major (stable, so rows keep the receive
        order inside an expert); each expert runs once on its contiguous slice; each output is scaled by its weight
        and written to its (row, slot) place, and the slots are summed in top-k order (deterministic, no atomics).
        """
        num_rows, num_topk = recv_topk_idx.shape
        hidden = recv_x.size(1)
        flat_idx = recv_topk_idx.reshape(-1)
        pairs = (flat_idx >= 0).nonzero().squeeze(1)
        _, perm = torch.sort(flat_idx.index_select(0, pairs), stable=True)
        pairs = pairs.index_select(0, perm)
        rows = torch.div(pairs, num_topk, rounding_mode="floor")
        expert_in = recv_x.index_select(0, rows)
        outputs = [
            _expert_output(expert, chunk)
            for expert, chunk in zip(self.experts.deepspeed_experts, torch.split(expert_in, counts))
        ]
        expert_out = torch.cat(outputs) if outputs else expert_in
        # fp32 weights: the product (and the route sum below) is fp32 for fp32/bf16 data, like DeepSpeed's decode.
        weights = recv_topk_weights.reshape(-1).index_select(0, pairs).unsqueeze(1)
        weighted = expert_out * weights
        slots = weighted.new_zeros((num_rows * num_topk, hidden)).index_copy(0, pairs, weighted)
        return slots.view(num_rows, num_topk, hidden).sum(1).to(recv_x.dtype)

    def _run_expert_rows(self, expert_in: torch.Tensor, probs: torch.Tensor, counts: List[int]) -> torch.Tensor:
        """Expert-side compute on expert-major rows: ``expert_in [M, hidden]`` (expert ``e`` owns ``counts[e]``
        contiguous rows) -> each row's output scaled by its gate weight ``probs [M]`` (fp32 product), ``[M, hidden]``
        in the input dtype. Each expert runs once on its slice."""
        outputs = [
            _expert_output(expert, chunk)
            for expert, chunk in zip(self.experts.deepspeed_experts, torch.split(expert_in, counts))
        ]
        expert_out = torch.cat(outputs) if outputs else expert_in
        return (expert_out * probs.unsqueeze(1)).to(expert_in.dtype)

    def forward(self, *input: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        self._check_supported()
        if self.wall_clock_breakdown:
            self.timers(_ds_sharded_moe.MOE_TIMER).start()
        hidden_states = input[0]
        used_token = input[1] if len(input) > 1 else None
        d_model = hidden_states.shape[-1]
        reshaped_input = hidden_states.reshape(-1, d_model)

        # The same gate call as DeepSpeed's MOELayer (sparse routes), so the same random numbers are drawn.
        self.l_aux, _capacity, num_experts, indices_, _locations, gates_, self.exp_counts = self.gate(
            reshaped_input, used_token, True, False
        )
        topk_idx = indices_.t().to(torch.int64).contiguous()  # [num_tokens, k], -1 = dropped by capacity
        topk_weights = gates_.t().float().contiguous()  # [num_tokens, k], differentiable (gate gradient)

        if self.wall_clock_breakdown:
            self.timers(_ds_sharded_moe.FIRST_ALLTOALL_TIMER).start()
        fused = False
        if self.ep_group is None:  # ep_size == 1 without a process group: every expert is local, nothing moves
            buffer, handle = None, None
            recv_x, recv_topk_idx, recv_topk_weights = reshaped_input, topk_idx, topk_weights
            counts = torch.bincount(topk_idx[topk_idx >= 0], minlength=num_experts).tolist()
        else:
            row_bytes = d_model * max(reshaped_input.element_size(), 2)
            buffer = _buffers.get(self.ep_group, row_bytes, reshaped_input.size(0))
            fused = bool(self.fused_permute)
            recv_x, recv_topk_idx, recv_topk_weights, counts, handle = ep_autograd.dispatch(
                buffer, reshaped_input.contiguous(), topk_idx, topk_weights, num_experts, expert_major=fused
            )
        if self.wall_clock_breakdown:
            self.timers(_ds_sharded_moe.FIRST_ALLTOALL_TIMER).stop()
            self.time_falltoall = self.timers(_ds_sharded_moe.FIRST_ALLTOALL_TIMER).elapsed(reset=False)

        if fused:  # received expert-major: no permute pass; combine reads the rows where they are
            layout = handle.expert_major
            expert_rows = self._run_expert_rows(recv_x, permute_probs(recv_topk_weights, layout), counts)
        elif self.fixed_order_unpermute:  # the fused path's arithmetic as separate passes
            layout = expert_major_layout(recv_topk_idx, len(counts), 1, sum(counts))
            expert_in = permute(recv_x, layout)
            expert_rows = unpermute(
                self._run_expert_rows(expert_in, permute_probs(recv_topk_weights, layout), counts), layout
            )
        else:  # the original path: permute, experts, weighted top-k-order sum per received row
            expert_rows = self._run_local_experts(recv_x, recv_topk_idx, recv_topk_weights, counts)

        if self.wall_clock_breakdown:
            self.timers(_ds_sharded_moe.SECOND_ALLTOALL_TIMER).start()
        combined = expert_rows if buffer is None else ep_autograd.combine(buffer, expert_rows, handle)
        if self.wall_clock_breakdown:
            self.timers(_ds_sharded_moe.SECOND_ALLTOALL_TIMER).stop()
            self.time_salltoall = self.timers(_ds_sharded_moe.SECOND_ALLTOALL_TIMER).elapsed(reset=False)
            self.timers(_ds_sharded_moe.MOE_TIMER).stop()
            self.time_moe = self.timers(_ds_sharded_moe.MOE_TIMER).elapsed(reset=False)
        return combined.reshape(hidden_states.shape)


class MoE(_DeepSpeedMoE):
    """``deepspeed.moe.layer.MoE`` with ep_dispatcher's dispatch/combine: same arguments, defaults, parameters.

    ``forward(hidden_states [..., hidden], used_token=None) -> (output [..., hidden], l_aux, exp_counts)``.
    ``k`` may be 1, 2 or more (DeepSpeed's gate: top-1 with RTS / noisy policy / ``used_token``, top-2 with
    2nd-expert sampling, general top-k). Raises ``NotImplementedError`` for ``use_tutel=True`` and
    ``enable_expert_tensor_parallelism=True``.
    """

    def __init__(
        self,
        hidden_size: int,
        expert: nn.Module,
        num_experts: int = 1,
        ep_size: int = 1,
        k: int = 1,
        capacity_factor: float = 1.0,
        eval_capacity_factor: float = 1.0,
        min_capacity: int = 4,
        use_residual: bool = False,
        noisy_gate_policy: Optional[str] = None,
        drop_tokens: bool = True,
        use_rts: bool = True,
        use_tutel: bool = False,
        enable_expert_tensor_parallelism: bool = False,
        top2_2nd_expert_sampling: bool = True,
    ) -> None:
        if use_tutel:
            raise NotImplementedError(
                "use_tutel: ep_dispatcher's MoE replaces the dispatch Tutel would speed up; "
                "expected use_tutel=False, got True"
            )
        if enable_expert_tensor_parallelism:
            raise NotImplementedError(
                "enable_expert_tensor_parallelism: tensor-parallel experts are not supported "
                "by ep_dispatcher's MoE; expected False, got True"
            )
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= num_experts:
            raise ValueError(f"k: expected an int in [1, num_experts={num_experts}], got {k!r}")
        super().__init__(
            hidden_size,
            expert,
            num_experts=num_experts,
            ep_size=ep_size,
            k=k,
            capacity_factor=capacity_factor,
            eval_capacity_factor=eval_capacity_factor,
            min_capacity=min_capacity,
            use_residual=use_residual,
            noisy_gate_policy=noisy_gate_policy,
            drop_tokens=drop_tokens,
            use_rts=use_rts,
            use_tutel=False,
            enable_expert_tensor_parallelism=False,
            top2_2nd_expert_sampling=top2_2nd_expert_sampling,
        )
        self.deepspeed_moe.__class__ = EPMOELayer

    def forward(
        self, hidden_states: torch.Tensor, used_token: Optional[torch.Tensor] = None
    ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """See the class docstring; identical to DeepSpeed's ``MoE.forward`` (residual MoE included)."""
        return super().forward(hidden_states, used_token)


def patch(model: nn.Module) -> int:
    """Switch every DeepSpeed ``MOELayer`` inside ``model`` to ep_dispatcher's dispatch path, in place.

    Parameters, buffers, ``state_dict`` keys and the expert-parallel groups are untouched (only the layers' class
    changes). Returns the number of layers switched; raises ``ValueError`` if ``model`` has no DeepSpeed MoE layer,
    ``NotImplementedError`` if a layer uses Tutel.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    layers = [m for m in model.modules() if isinstance(m, _DeepSpeedMOELayer)]
    if not layers:
        raise ValueError(
            "model: contains no deepspeed.moe.sharded_moe.MOELayer (build it with deepspeed.moe.layer.MoE)"
        )
    switched = 0
    for layer in layers:
        if type(layer) is EPMOELayer:
            continue
        if type(layer) is not _DeepSpeedMOELayer:
            raise TypeError(
                f"model: layer of type {type(layer).__name__} subclasses DeepSpeed's MOELayer with its "
                "own behaviour; patch() only switches DeepSpeed's own MOELayer"
            )
        if layer.use_tutel:
            raise NotImplementedError("model: a layer uses Tutel (use_tutel=True), which patch() does not support")
        layer.__class__ = EPMOELayer
        switched += 1
    return switched


def unpatch(model: nn.Module) -> int:
    """Undo :func:`patch`: every :class:`EPMOELayer` in ``model`` goes back to DeepSpeed's ``MOELayer``.

    Also applies to layers built by :class:`MoE` (the ``MoE`` object keeps its class; only its dispatch path
    changes). Returns the number of layers switched back.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    switched = 0
    for layer in model.modules():
        if type(layer) is EPMOELayer:
            layer.__class__ = _DeepSpeedMOELayer
            switched += 1
    return switched
