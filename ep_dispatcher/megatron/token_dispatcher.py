"""``EPDispatcherTokenDispatcher``: Megatron-core's ``MoETokenDispatcher`` stage interface on ``ep_dispatcher``.

Stages (what ``MoELayer`` and the EP-overlap schedule call, in order, once per micro-batch):

============================  =========================================================================================
``dispatch_preprocess``        ``[S, B, H] -> [N, H]``; routing map + probs -> top-k ids and fp32 weights over the
                               ``TP x EP`` group (TP folded in as Megatron's flex dispatcher does). No communication.
``token_dispatch``             ``ep_dispatcher.autograd.dispatch`` over the ``TP x EP`` group (backward = combine of the
                               gradients, weight gradients summed back to ``[N, k]``). Returns ``(recv_x, recv_probs)``;
                               with the fused permute ``recv_x`` is already expert-major.
``dispatch_postprocess``       expert-major layout: each received token once per local expert it selected,
                               ordered by local expert, then by received order (= the ``allgather`` dispatcher's order);
                               fused: only the probabilities are permuted (the rows arrived in place); unfused: a
                               separate permute pass. ``tokens_per_expert`` is the dispatch's host count list as a CPU
                               int64 tensor (no sync).
``combine_preprocess``         un-permute: sum each token's local-expert outputs (fp32, one rounding; the experts
                               already applied the probabilities). Fused: nothing here, the
                               combine reads the expert-major rows and does the same sum.
``token_combine``              ``ep_dispatcher.autograd.combine``: unweighted sum back to the source tokens.
``combine_postprocess``        ``[N, H] -> [S, B, H]`` (+ the overlapped shared-expert output).
============================  =========================================================================================

Every stage reads the tensors it is given (not copies cached on ``self``): the EP-overlap schedule hands each node
detached inputs (``probs`` of ``token_dispatch``, ``probs`` of ``dispatch_postprocess``), so gradients stop at the
node boundary and the schedule moves them across. What is cached on ``self`` (top-k ids, handle, permutation) is
forward-only bookkeeping of the micro-batch in flight; backward state lives on the autograd graph.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.moe.token_dispatcher import MoETokenDispatcher

from .. import autograd as ep_autograd
from ..buffer import Buffer
from ..expert_major import ExpertMajorLayout, expert_major_layout, permute, permute_probs, unpermute
from . import buffer_cache
from .routing import expert_major_order, fold_tensor_parallel, routing_to_topk

DEFAULT_NUM_SMS = 20  # Megatron's historical DeepEP default when no SM count is configured
_NUM_SMS_FIELDS = ("moe_flex_dispatcher_num_sms", "moe_deepep_num_sms")  # 0.19 name first, then 0.16-0.18


def configured_num_sms(config) -> int:
    """SMs for dispatch/combine from the Megatron config (first field of ``_NUM_SMS_FIELDS`` that is set)."""
    for name in _NUM_SMS_FIELDS:
        value = getattr(config, name, None)
        if value is not None:
            return int(value)
    return DEFAULT_NUM_SMS


class EPDispatcherTokenDispatcher(MoETokenDispatcher):
    """Token dispatcher for ``moe_token_dispatcher_type="deepep"`` (and ``"flex"`` with backend ``"deepep"`` after
    ``ep_dispatcher.megatron.install()``).

    Args:
        num_local_experts: experts on this EP rank.
        local_expert_indices: their global ids.
        config: the layer's ``TransformerConfig``.
        pg_collection: Megatron's process groups (``ep``, ``expt_tp``, ``tp_ep``).

    Permute modes (class attributes; set them on the class (all layers) or an instance before its first forward):

    * ``fused_permute`` (default True, ``docs/fused_permute.md``): dispatch straight into expert-major rows and
      combine from them (``Buffer.dispatch(..., expert_major=True)``), so no separate permute / un-permute pass runs
      in the plugin; outputs and gradients bit-identical to ``fixed_order_unpermute = True`` below.
    * unfused (``fused_permute = False``), ``fixed_order_unpermute = False`` (default): separate passes, the
      original implementation: an ``index_select`` permute and an ``index_add`` un-permute (fp32 accumulation; on
      the GPU ``index_add`` uses atomics, so the summation order of a token's local-expert rows is not fixed).
    * unfused, ``fixed_order_unpermute = True``: separate passes with ``ep_dispatcher.expert_major.permute`` /
      ``unpermute`` (fp32 sum in local-expert order, one rounding): deterministic, and bit-identical to the fused
      path in outputs and gradients.
    """

    fused_permute: bool = True
    fixed_order_unpermute: bool = False

    def __init__(self, num_local_experts: int, local_expert_indices: list[int], config, pg_collection=None) -> None:
        if pg_collection is None:
            from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

            pg_collection = get_default_pg_collection()
        super().__init__(config=config, pg_collection=pg_collection)
        if num_local_experts < 1:
            raise ValueError(f"num_local_experts: expected >= 1, got {num_local_experts}")
        self.num_local_experts = num_local_experts
        self.local_expert_indices = list(local_expert_indices)
        self.router_topk = config.moe_router_topk
        self.router_dtype = getattr(config, "moe_router_dtype", None)
        self.comm_group = getattr(self, "tp_ep_group", None)
        if self.comm_group is None:  # versions whose base class does not keep the TP x EP group
            self.comm_group = pg_collection.tp_ep
        self.comm_size = self.tp_size * self.ep_size
        # TP is folded into the expert space: TP x EP ranks, each with num_local_experts "experts".
        self.num_comm_experts = self.tp_size * config.num_moe_experts
        for name in (
            "moe_pad_expert_input_to_capacity",
            "moe_router_padding_for_quantization",
            "moe_router_padding_for_fp8",
        ):
            if getattr(config, name, False):
                raise NotImplementedError(
                    f"EPDispatcherTokenDispatcher: {name}=True is not supported (tokens are "
                    "received without padding); turn it off"
                )
        num_sms = configured_num_sms(config)
        if num_sms != Buffer.num_sms:
            Buffer.set_num_sms(num_sms)

        self.hidden_shape: torch.Size | None = None
        self.token_indices: torch.Tensor | None = None  # [N, tp*k] int64 over the TP x EP expert space
        self.token_probs: torch.Tensor | None = None  # [N, tp*k] float32
        self.handle = None
        self._handle_buffer: Buffer | None = None
        self.dispatched_indices: torch.Tensor | None = None  # [R, tp*k] local ids, -1 elsewhere
        self.dispatched_probs: torch.Tensor | None = None
        self.tokens_per_expert: torch.Tensor | None = None
        # Expert-major bookkeeping of the micro-batch in flight, by permute mode: the original path keeps the
        # received-row index of each expert input row; the fixed-order and fused paths keep an ExpertMajorLayout.
        self.permutation: torch.Tensor | None = None  # [num_out] received-row index of each expert input row
        self.num_recv_tokens = 0
        self.layout: ExpertMajorLayout | None = None
        self.layout_fused = False  # whether token_dispatch received straight into that layout
        self.cudagraph_attrs = ["token_probs", "token_indices"]

    # Megatron's EP-overlap callables write detached tensors to ``token_dispatcher._comm_manager.<name>`` for the
    # flex dispatcher; with ``self`` as the manager those writes land on the attributes above.
    @property
    def _comm_manager(self) -> EPDispatcherTokenDispatcher:
        return self

    def get_number_of_tokens_per_expert(self) -> torch.Tensor | None:
        """``[num_local_experts] int64`` CPU tensor of the micro-batch in flight."""
        return self.tokens_per_expert

    # ------------------------------------------------------------------ dispatch
    def dispatch_preprocess(self, hidden_states: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor):
        """``hidden_states [S, B, H]`` -> ``[N, H]``; returns ``(tokens [N, H], token_probs [N, tp*k] float32)``."""
        self.hidden_shape = hidden_states.shape
        hidden_states = hidden_states.reshape(-1, self.hidden_shape[-1])
        num_tokens = hidden_states.size(0)
        routing_map = routing_map.reshape(num_tokens, -1)
        probs = probs.reshape(num_tokens, -1)
        topk_idx, topk_weights = routing_to_topk(routing_map, probs, self.router_topk)
        self.token_indices, self.token_probs = fold_tensor_parallel(
            topk_idx, topk_weights, self.num_local_experts, self.tp_size
        )
        return hidden_states, self.token_probs

    def token_dispatch(
        self,
        hidden_states: torch.Tensor,
        probs: torch.Tensor | None = None,
        async_finish: bool = True,
        allocate_on_comm_stream: bool = True,
    ):
        """Send each token to the ranks of its experts.

        ``async_finish`` / ``allocate_on_comm_stream`` are accepted for signature compatibility with the flex
        dispatcher; the call is ordered on the current stream (the schedule's communication stream under
        EP overlap), which is what those flags buy there.

        Returns ``(recv_x [R, H], recv_probs [R, tp*k] float32)``.
        """
        if probs is None:
            probs = self.token_probs
        probs = probs.float()
        if not probs.is_contiguous():
            probs = probs.contiguous()
        # Shared-expert overlap exists here on 0.18+ only: 0.16/0.17 refuse it for flex (so for "deepep") and their
        # SharedExpertMLP has no wait_current_stream / pre_forward_comm(wait_current_stream=...).
        if self.shared_experts is not None:
            self.shared_experts.wait_current_stream()
        hidden_bytes = hidden_states.size(1) * max(hidden_states.element_size(), 2)
        buffer = buffer_cache.get_buffer(self.comm_group, hidden_bytes, hidden_states.size(0))
        fused = bool(self.fused_permute)
        recv_x, recv_indices, recv_probs, counts, handle = ep_autograd.dispatch(
            buffer, hidden_states.contiguous(), self.token_indices, probs, self.num_comm_experts, expert_major=fused
        )
        self.handle, self._handle_buffer = handle, buffer  # combine must use the buffer that dispatched
        self.dispatched_indices = recv_indices
        self.dispatched_probs = recv_probs
        self.tokens_per_expert = torch.tensor(counts, dtype=torch.int64)
        self.layout_fused = fused
        if fused:
            self.layout = handle.expert_major
        elif self.fixed_order_unpermute:
            self.layout = expert_major_layout(recv_indices, self.num_local_experts, 1, int(sum(counts)))
        else:
            self.layout = None  # the original path: dispatch_postprocess computes its permutation
        if self.shared_experts is not None:
            self.shared_experts.pre_forward_comm(hidden_states, wait_current_stream=False)
            self.shared_experts.linear_fc1_forward_and_act(recv_x)
        return recv_x, recv_probs

    def dispatch_postprocess(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        """Expert-major rows of the received tokens (already in place with the fused permute).

        Returns ``(expert_input [sum(tokens_per_expert), H], tokens_per_expert [E_local] int64 CPU,
        permuted_probs [sum(tokens_per_expert)] float32, or float64 with router dtype fp64)``.
        """
        if probs is None:
            probs = self.dispatched_probs
        if self.layout is None:  # the original unfused path (index_select here, index_add in combine_preprocess)
            num_topk = self.dispatched_indices.size(1)
            num_out = int(self.tokens_per_expert.sum())
            order = expert_major_order(self.dispatched_indices, self.num_local_experts, num_out)
            self.permutation = order.div(num_topk, rounding_mode="floor")
            self.num_recv_tokens = hidden_states.size(0)
            expert_input = hidden_states.index_select(0, self.permutation)
            permuted_probs = probs.reshape(-1).index_select(0, order)
        else:
            expert_input = hidden_states if self.layout_fused else permute(hidden_states, self.layout)
            permuted_probs = permute_probs(probs, self.layout)
        if self.router_dtype == "fp64":
            permuted_probs = permuted_probs.double()
        return expert_input, self.tokens_per_expert, permuted_probs

    # ------------------------------------------------------------------ combine
    def combine_preprocess(self, hidden_states: torch.Tensor):
        """Sum each received token's local-expert outputs, ``[num_out, H]`` -> ``[R, H]`` (fp32 accumulation, one
        rounding; the fixed-order path sums in local-expert order). With the fused permute the expert-major rows pass
        through: the combine does that sum."""
        layout, fused = self.layout, self.layout_fused
        self.layout = None
        if layout is not None:
            return hidden_states if fused else unpermute(hidden_states, layout)
        accumulate = torch.float32 if hidden_states.dtype in (torch.bfloat16, torch.float16) else hidden_states.dtype
        out = torch.zeros((self.num_recv_tokens, hidden_states.size(1)), dtype=accumulate, device=hidden_states.device)
        out = out.index_add(0, self.permutation, hidden_states.to(accumulate))
        self.permutation = None
        return out.to(hidden_states.dtype)

    def token_combine(
        self, hidden_states: torch.Tensor, async_finish: bool = True, allocate_on_comm_stream: bool = True
    ):
        """Unweighted sum of the expert outputs back to the source tokens: ``[R, H]`` -> ``[N, H]``."""
        if self.shared_experts is not None:
            self.shared_experts.wait_current_stream()
        handle, buffer = self.handle, self._handle_buffer
        self.handle = self._handle_buffer = None
        combined = ep_autograd.combine(buffer, hidden_states.contiguous(), handle)
        self.dispatched_indices = None
        self.dispatched_probs = None
        return combined

    def combine_postprocess(self, hidden_states: torch.Tensor):
        """``[N, H]`` -> the layer's input shape, plus the overlapped shared-expert output."""
        if self.shared_experts is not None:
            self.shared_experts.linear_fc2_forward(hidden_states)
            self.shared_experts.post_forward_comm()
            hidden_states = hidden_states + self.shared_experts.get_output()
        return hidden_states.view(self.hidden_shape)
