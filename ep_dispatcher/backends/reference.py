"""Reference backend: the semantics of every ``Buffer`` call in plain PyTorch + ``torch.distributed``.

This is the specification in executable form. Each call moves bytes with ``all_to_all_single`` (gloo on CPU,
NCCL on GPUs; CUDA tensors on a gloo group are staged through host memory), and computes every derived value
(orders, counts, handles, FP8 casts, sums) in the exact order the CUDA engine must reproduce:

* dispatch receive order: source rank ascending, source token order kept inside a rank;
* combine, group within one node: ``acc = 0 + bias_0 + bias_1`` (fp32), then ``acc += y_r`` over the ranks ``r``
  that received the token, ascending, one rounding to the output dtype at the end;
* combine, group spanning several nodes (``num_ranks > num_ranks_per_node``; node ``n`` = ranks
  ``n * P .. n * P + P - 1``): per node ``n`` that received the token, ``p_n = 0 + y_r`` summed in fp32 over that
  node's ranks ``r`` ascending, rounded to the output dtype (the internode engine sends ``p_n`` over the RDMA leg in
  that dtype); then ``acc = 0 + bias_0 + bias_1``, ``acc += float(p_n)`` over those nodes ascending, in fp32, one
  rounding at the end. Combined top-k weights: ``0 + sum_n (0 + sum_{r in n} w_r)`` in fp32, same orders;
* expert-major dispatch (fused permute, ``ep_dispatcher/expert_major.py``): the normal dispatch, then each
  (received token, local expert) pair copied to its expert-major row (experts ascending, each padded to
  ``expert_alignment`` with zero rows, received order inside an expert); its combine first sums each token's rows in
  row order (fp32, one rounding to the input dtype), then combines as above;
* low-latency slots: per local expert, source rank ascending, token index ascending inside a rank;
* low-latency combine: ``acc = 0``; for ``k`` ascending over valid top-k entries ``acc = fl(acc + fl(w_k * y_k))``
  in fp32, then one rounding to BF16.

Payloads travel as ``uint8`` views (gloo has no float8/int16 collectives). Argument validation happens in
``Buffer`` before a backend is called.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ..expert_major import permute_rows, to_expert_major, unpermute_sum
from ..fp8 import per_token_cast_to_fp8
from ..logfmt import logfmt_roundtrip
from ..low_latency_state import allocate_dispatch_outputs
from ..validation import tokens_per_rank_mismatch
from ..handles import DispatchHandle
from .base import CombineArgs, DispatchArgs, LowLatencyCombineArgs, LowLatencyDispatchArgs


def _row_bytes(t: torch.Tensor) -> int:
    return math.prod(t.shape[1:]) * t.element_size()


def _pack_rows(parts: Sequence[torch.Tensor]) -> Tuple[torch.Tensor, List[int]]:
    """Concatenate per-row fields of different dtypes into one ``[rows, bytes]`` uint8 matrix."""
    widths = [_row_bytes(p) for p in parts]
    rows = parts[0].size(0)
    device = parts[0].device
    if rows == 0:
        return torch.empty((0, sum(widths)), dtype=torch.uint8, device=device), widths
    return torch.cat([p.contiguous().view(torch.uint8).reshape(rows, -1) for p in parts], dim=1), widths


def _unpack_rows(packed: torch.Tensor, widths: Sequence[int], templates: Sequence[Tuple[torch.dtype, Tuple[int, ...]]]):
    """Inverse of :func:`_pack_rows`: ``templates`` gives (dtype, per-row shape) of each field."""
    out, offset = [], 0
    rows = packed.size(0)
    for width, (dtype, shape) in zip(widths, templates):
        field = packed[:, offset : offset + width].contiguous()
        offset += width
        out.append(
            field.view(dtype).reshape((rows, *shape))
            if rows > 0
            else torch.empty((0, *shape), dtype=dtype, device=packed.device)
        )
    return out


@dataclass(frozen=True)
class ReferenceDispatchState:
    """What a reference dispatch keeps for its cached dispatches and combine (``DispatchHandle.backend_state``).

    send_idx: ``[sum(send_counts)] int64``, this rank's tokens in send order (destination rank ascending, token order
        inside); send_counts / recv_counts: rows sent to / received from each rank; num_recv: ``sum(recv_counts)``.
    """

    send_idx: torch.Tensor
    send_counts: List[int]
    recv_counts: List[int]
    num_recv: int


@dataclass(frozen=True)
class ReferenceLowLatencyState:
    """What a reference low-latency dispatch keeps for its combine (``LowLatencyHandle.backend_state``).

    send_token / send_k: token and top-k column of each message sent, in send order; send_counts / recv_counts:
    messages sent to / received from each rank; recv_flat_slot: ``expert * num_slots + slot`` of each received one.
    """

    send_token: torch.Tensor
    send_k: torch.Tensor
    send_counts: List[int]
    recv_counts: List[int]
    recv_flat_slot: torch.Tensor


class ReferenceBackend:
    """Pure-PyTorch implementation of every call; see the module docstring for the exact semantics."""

    name = "reference"

    def engine_calls(self) -> tuple:
        """Calls that run as CUDA kernels on this backend: none."""
        return ()

    # Payload dtypes combine and dispatch accept: fp64 lets autograd tests run gradcheck.
    float_dtypes = (torch.bfloat16, torch.float16, torch.float32, torch.float64)

    def __init__(self, group: dist.ProcessGroup, rank: int, num_ranks: int, num_ranks_per_node: int, **_engine_options):
        self.group = group
        self.rank = rank
        self.num_ranks = num_ranks
        self.num_ranks_per_node = num_ranks_per_node
        # gloo moves CPU tensors only: CUDA payloads are staged through host memory.
        self._stage_on_host = dist.get_backend(group) == "gloo"
        self._ll_combine_buffers = {}

    # ------------------------------------------------------------------ collectives
    def _comm_device(self, device: torch.device) -> torch.device:
        """Where a tensor must live for this group's collectives: host for gloo, a GPU for NCCL."""
        if self._stage_on_host:
            return torch.device("cpu")
        return device if device.type == "cuda" else torch.device("cuda", torch.cuda.current_device())

    def _all_to_all_rows(self, rows: torch.Tensor, send_counts: List[int], recv_counts: List[int]) -> torch.Tensor:
        """Exchange ``[sum(send_counts), row_bytes]`` uint8 rows; returns ``[sum(recv_counts), row_bytes]``."""
        row_bytes = rows.size(1)
        device = rows.device
        send = rows.to(self._comm_device(device)).reshape(-1)
        recv = torch.empty(sum(recv_counts) * row_bytes, dtype=torch.uint8, device=send.device)
        if row_bytes > 0:
            dist.all_to_all_single(
                recv, send, [c * row_bytes for c in recv_counts], [c * row_bytes for c in send_counts], group=self.group
            )
        return recv.view(sum(recv_counts), row_bytes).to(device)

    def _all_gather_counts(self, counts: torch.Tensor) -> torch.Tensor:
        """``counts [n]`` of every rank -> ``[num_ranks, n]`` int64 (row = source rank)."""
        local = counts.to(torch.int64).to(self._comm_device(counts.device))
        gathered = [torch.empty_like(local) for _ in range(self.num_ranks)]
        dist.all_gather(gathered, local, group=self.group)
        return torch.stack(gathered).cpu()

    # ------------------------------------------------------------------ layout
    def checks_topk_idx_on_device(self, call: str, topk_idx: torch.Tensor) -> bool:
        """Whether ``call`` checks the range of ``topk_idx`` itself (on the device, no host sync); the reference
        backend never does, so ``Buffer`` checks at once."""
        return False

    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int):
        num_tokens = topk_idx.size(0)
        num_ranks, per_node = self.num_ranks, self.num_ranks_per_node
        num_local_experts = num_experts // num_ranks
        valid = topk_idx >= 0
        rank_of = torch.where(valid, topk_idx // num_local_experts, torch.full_like(topk_idx, num_ranks))
        # A spare column num_ranks soaks up the -1 entries, so one scatter deduplicates per token.
        in_rank = torch.zeros((num_tokens, num_ranks + 1), dtype=torch.bool, device=topk_idx.device)
        in_rank.scatter_(1, rank_of, True)
        is_token_in_rank = in_rank[:, :num_ranks].contiguous()
        num_tokens_per_rank = is_token_in_rank.sum(0, dtype=torch.int32)
        num_tokens_per_expert = torch.bincount(topk_idx[valid], minlength=num_experts).to(torch.int32)
        num_tokens_per_rdma_rank = None
        if num_ranks > per_node:
            num_nodes = num_ranks // per_node
            node_of = torch.where(valid, rank_of // per_node, torch.full_like(topk_idx, num_nodes))
            in_node = torch.zeros((num_tokens, num_nodes + 1), dtype=torch.bool, device=topk_idx.device)
            in_node.scatter_(1, node_of, True)
            num_tokens_per_rdma_rank = in_node[:, :num_nodes].sum(0, dtype=torch.int32)
        return num_tokens_per_rank, num_tokens_per_rdma_rank, num_tokens_per_expert, is_token_in_rank

    # ------------------------------------------------------------------ high-throughput dispatch / combine
    def dispatch(self, args: DispatchArgs):
        """Normal dispatch.

        Returns ``(recv_x, recv_x_scales, recv_topk_idx, recv_topk_weights, per_expert_list, handle)``.
        """
        x, x_scales, is_token_in_rank = args.x, args.x_scales, args.is_token_in_rank
        topk_idx, topk_weights, num_experts = args.topk_idx, args.topk_weights, args.num_experts
        expert_alignment, num_worst_tokens = args.expert_alignment, args.num_worst_tokens
        num_tokens_per_rank, num_tokens_per_expert = args.num_tokens_per_rank, args.num_tokens_per_expert
        device = x.device
        send_counts_t = is_token_in_rank.sum(0, dtype=torch.int64).cpu()
        if num_tokens_per_rank is not None:
            error = tokens_per_rank_mismatch(send_counts_t.tolist(), num_tokens_per_rank.tolist())
            if error is not None:
                raise error
        # Tokens for rank r, in source order, concatenated over r ascending.
        dest, token = torch.nonzero(is_token_in_rank.t(), as_tuple=True)
        send_idx = token.to(device)
        count_matrix = self._all_gather_counts(send_counts_t)
        send_counts = send_counts_t.tolist()
        recv_counts = count_matrix[:, self.rank].tolist()
        num_recv = sum(recv_counts)

        parts = [x[send_idx], send_idx.to(torch.int32).unsqueeze(1)]
        templates = [(x.dtype, tuple(x.shape[1:])), (torch.int32, (1,))]
        if x_scales is not None:
            parts.append(x_scales[send_idx])
            templates.append((x_scales.dtype, tuple(x_scales.shape[1:])))
        if topk_idx is not None:
            parts += [topk_idx[send_idx], topk_weights[send_idx]]
            templates += [
                (topk_idx.dtype, tuple(topk_idx.shape[1:])),
                (topk_weights.dtype, tuple(topk_weights.shape[1:])),
            ]
        packed, widths = _pack_rows(parts)
        fields = _unpack_rows(self._all_to_all_rows(packed, send_counts, recv_counts), widths, templates)
        recv_x, recv_src_idx = fields[0], fields[1].view(-1)
        fields = fields[2:]
        recv_x_scales = fields.pop(0) if x_scales is not None else None

        recv_topk_idx = recv_topk_weights = per_expert = None
        per_expert_list: List[int] = []
        if topk_idx is not None:
            recv_topk_global, recv_topk_weights = fields
            num_local_experts = num_experts // self.num_ranks
            local = recv_topk_global - self.rank * num_local_experts
            is_local = (recv_topk_global >= 0) & (local >= 0) & (local < num_local_experts)
            recv_topk_idx = torch.where(is_local, local, torch.full_like(local, -1))
            recv_topk_weights = torch.where(is_local, recv_topk_weights, torch.zeros_like(recv_topk_weights))
            counts = torch.bincount(recv_topk_idx[is_local], minlength=num_local_experts)
            aligned = (counts + expert_alignment - 1) // expert_alignment * expert_alignment
            per_expert = aligned.to(torch.int32)
            per_expert_list = per_expert.tolist() if num_worst_tokens == 0 else []
        elif num_tokens_per_expert is not None:
            # No top-k (DeepEP allows it): the receive list is the sum of every source rank's counts for this
            # rank's experts, each rounded up to expert_alignment.
            num_local_experts = num_experts // self.num_ranks
            counts = self._all_gather_counts(num_tokens_per_expert)[:, self.rank * num_local_experts :]
            counts = counts[:, :num_local_experts].sum(0)
            aligned = (counts + expert_alignment - 1) // expert_alignment * expert_alignment
            per_expert = aligned.to(torch.int32).to(device)
            per_expert_list = aligned.tolist() if num_worst_tokens == 0 else []

        if num_worst_tokens > 0:
            if num_recv > num_worst_tokens:
                raise RuntimeError(
                    f"num_worst_tokens: rank {self.rank} received {num_recv} tokens, more than "
                    f"num_worst_tokens={num_worst_tokens}; raise it to the worst case"
                )
            recv_x = self._pad_rows(recv_x, num_worst_tokens, 0)
            recv_x_scales = self._pad_rows(recv_x_scales, num_worst_tokens, 0)
            recv_topk_idx = self._pad_rows(recv_topk_idx, num_worst_tokens, -1)
            recv_topk_weights = self._pad_rows(recv_topk_weights, num_worst_tokens, 0)
            recv_src_idx = self._pad_rows(recv_src_idx, num_worst_tokens, -1)

        rank_prefix_matrix = torch.cumsum(count_matrix, dim=0).to(torch.int32).to(device)
        handle = DispatchHandle(
            buffer_id=args.buffer_id,
            num_ranks=self.num_ranks,
            rank_prefix_matrix=rank_prefix_matrix,
            recv_src_idx=recv_src_idx,
            is_token_in_rank=is_token_in_rank,
            num_recv_tokens=num_recv if num_worst_tokens == 0 else -1,
            num_recv_tokens_per_expert=per_expert,
            num_worst_tokens=num_worst_tokens,
            expert_alignment=expert_alignment,
            backend_state=ReferenceDispatchState(send_idx, send_counts, recv_counts, num_recv),
            rank=self.rank,
            num_ranks_per_node=self.num_ranks_per_node,
        )
        return recv_x, recv_x_scales, recv_topk_idx, recv_topk_weights, per_expert_list, handle

    @staticmethod
    def _pad_rows(t: Optional[torch.Tensor], rows: int, fill) -> Optional[torch.Tensor]:
        if t is None:
            return None
        out = torch.empty((rows, *t.shape[1:]), dtype=t.dtype, device=t.device)
        if out.dtype == torch.float8_e4m3fn:
            out.view(torch.uint8).fill_(0)
        else:
            out.fill_(fill)
        out[: t.size(0)] = t
        return out

    def cached_dispatch(self, x: torch.Tensor, x_scales: Optional[torch.Tensor], handle: DispatchHandle, config=None):
        state: ReferenceDispatchState = handle.backend_state
        send_idx = state.send_idx
        parts, templates = [x[send_idx]], [(x.dtype, tuple(x.shape[1:]))]
        if x_scales is not None:
            parts.append(x_scales[send_idx])
            templates.append((x_scales.dtype, tuple(x_scales.shape[1:])))
        packed, widths = _pack_rows(parts)
        fields = _unpack_rows(self._all_to_all_rows(packed, state.send_counts, state.recv_counts), widths, templates)
        recv_x = fields[0]
        recv_x_scales = fields[1] if x_scales is not None else None
        if handle.num_worst_tokens > 0:
            recv_x = self._pad_rows(recv_x, handle.num_worst_tokens, 0)
            recv_x_scales = self._pad_rows(recv_x_scales, handle.num_worst_tokens, 0)
        return recv_x, recv_x_scales

    def combine(self, args: CombineArgs):
        """Sum each token's rows from every rank that received it. Returns ``(combined_x, combined_topk_weights)``.

        Order (fp32, fp64 for fp64 input): one node: ``0 + bias_0 + bias_1 + y_r`` over ranks ascending. Several
        nodes: node partials ``p_n = 0 + y_r`` over the node's ranks ascending, each rounded to ``x.dtype``, then
        ``0 + bias_0 + bias_1 + p_n`` over nodes ascending; nodes/ranks that did not receive the token are skipped.
        One rounding of the total to ``x.dtype``.
        """
        x, handle, topk_weights, bias = args.x, args.handle, args.topk_weights, args.bias
        state: ReferenceDispatchState = handle.backend_state
        num_recv = state.num_recv
        send_idx, send_counts, recv_counts = state.send_idx, state.send_counts, state.recv_counts
        acc_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
        parts = [x[:num_recv]]
        templates = [(x.dtype, tuple(x.shape[1:]))]
        if topk_weights is not None:
            parts.append(topk_weights[:num_recv])
            templates.append((topk_weights.dtype, tuple(topk_weights.shape[1:])))
        packed, widths = _pack_rows(parts)
        # The way back is the way out reversed: rows grouped by source rank go home, and arrive in the order
        # this rank sent them (destination rank ascending, token order inside).
        fields = _unpack_rows(self._all_to_all_rows(packed, recv_counts, send_counts), widths, templates)
        back_x = fields[0]
        num_tokens = handle.num_tokens
        combined = torch.zeros((num_tokens, x.size(1)), dtype=acc_dtype, device=x.device)
        for b in bias:
            combined += b.to(acc_dtype)
        # index_add_ would sum several ranks' rows of one token in an unspecified order; one rank at a time
        # keeps the order fixed (destination rank ascending) and each step touches a token at most once.
        offsets = [0]
        for c in send_counts:
            offsets.append(offsets[-1] + c)
        combined_w = None
        if topk_weights is not None:
            combined_w = torch.zeros((num_tokens, topk_weights.size(1)), dtype=torch.float32, device=x.device)
        per_node = self.num_ranks_per_node
        if self.num_ranks <= per_node:
            for r in range(self.num_ranks):
                lo, hi = offsets[r], offsets[r + 1]
                if hi == lo:
                    continue
                idx = send_idx[lo:hi]
                combined[idx] = combined[idx] + back_x[lo:hi].to(acc_dtype)
                if combined_w is not None:
                    combined_w[idx] = combined_w[idx] + fields[1][lo:hi].to(torch.float32)
            return combined.to(x.dtype), combined_w
        # Several nodes: reduce inside each node first (the partial is rounded to x.dtype, as the engine sends it
        # over the RDMA leg), then across nodes in node order.
        for n in range(self.num_ranks // per_node):
            partial = torch.zeros_like(combined)
            partial_w = torch.zeros_like(combined_w) if combined_w is not None else None
            present = torch.zeros(num_tokens, dtype=torch.bool, device=x.device)
            for r in range(n * per_node, (n + 1) * per_node):
                lo, hi = offsets[r], offsets[r + 1]
                if hi == lo:
                    continue
                idx = send_idx[lo:hi]
                present[idx] = True
                partial[idx] = partial[idx] + back_x[lo:hi].to(acc_dtype)
                if partial_w is not None:
                    partial_w[idx] = partial_w[idx] + fields[1][lo:hi].to(torch.float32)
            rounded = partial.to(x.dtype).to(acc_dtype)
            combined[present] = combined[present] + rounded[present]
            if combined_w is not None:
                combined_w[present] = combined_w[present] + partial_w[present]
        return combined.to(x.dtype), combined_w

    # ------------------------------------------------------------------ expert-major dispatch / combine (fused permute)
    # The specification is the composition below (normal call + ``expert_major`` permute / un-permute); an engine with
    # a fused kernel overrides these three methods and must match them bit for bit.
    def dispatch_expert_major(self, args: DispatchArgs):
        """Dispatch whose ``recv_x`` (and scales) are expert-major ``[M, ...]``; ``handle.expert_major`` holds the
        layout. Returns what ``dispatch`` returns (top-k outputs stay in received order)."""
        return to_expert_major(self.dispatch(args), args.num_experts // self.num_ranks, args.expert_alignment)

    def cached_dispatch_expert_major(self, x, x_scales, handle: DispatchHandle, config=None):
        """Cached dispatch into the handle's expert-major layout: ``(recv_x [M, ...], recv_x_scales | None)``."""
        recv, recv_scales = self.cached_dispatch(x, x_scales, handle, config=config)
        return permute_rows(recv, handle.expert_major), permute_rows(recv_scales, handle.expert_major)

    def combine_expert_major(self, args: CombineArgs):
        """Combine of an expert-major ``args.x [M, H]``: per received token, its rows summed in row order (fp32, one
        rounding to ``x.dtype``), then ``combine``. Returns ``(combined_x, combined_topk_weights)``."""
        return self.combine(replace(args, x=unpermute_sum(args.x, args.handle.expert_major)))

    # ------------------------------------------------------------------ low-latency dispatch / combine
    def low_latency_dispatch(self, args: LowLatencyDispatchArgs):
        """Exchange now; returns ``(handle, (recv_x, recv_scales, recv_count), receive)`` where ``receive()`` fills
        those outputs (and adds ``recv_count`` to ``cumulative_stats``). ``half`` (the buffer half) only matters to
        engines. ``wait_stats`` (``dispatch_wait_recv_cost_stats``, ``[num_ranks] int64``) is left as it is, i.e.
        0 is added for every rank: the exchange is a blocking collective, which exposes no per-peer wait to
        measure (the CUDA engine adds the cycles its receive kernel spins per source rank)."""
        x, topk_idx, num_experts, cumulative_stats = args.x, args.topk_idx, args.num_experts, args.cumulative_stats
        use_fp8, round_scale, use_ue8m0 = args.use_fp8, args.round_scale, args.use_ue8m0
        num_tokens, hidden = x.shape
        num_topk = topk_idx.size(1)
        num_ranks, device = self.num_ranks, x.device
        num_local_experts = num_experts // num_ranks
        max_tokens = args.num_max_dispatch_tokens_per_rank
        num_slots = num_ranks * max_tokens

        # One message per valid (token, k) entry, ordered by (destination rank, local expert, token): the
        # destination then fills each expert's slots in arrival order = (source rank, token) ascending.
        token_of = torch.arange(num_tokens, device=device).unsqueeze(1).expand(num_tokens, num_topk).reshape(-1)
        k_of = torch.arange(num_topk, device=device).unsqueeze(0).expand(num_tokens, num_topk).reshape(-1)
        expert = topk_idx.reshape(-1)
        valid = expert >= 0
        token_of, k_of, expert = token_of[valid], k_of[valid], expert[valid]
        order = torch.argsort(expert * num_tokens + token_of, stable=True)
        token_of, k_of, expert = token_of[order], k_of[order], expert[order]
        dest = expert // num_local_experts
        send_counts = torch.bincount(dest, minlength=num_ranks).cpu()
        recv_counts = self._all_gather_counts(send_counts)[:, self.rank].tolist()
        send_counts = send_counts.tolist()

        if use_fp8:
            x_fp8, scales = per_token_cast_to_fp8(x, round_scale=round_scale, use_ue8m0=use_ue8m0)
            payload = [x_fp8[token_of], scales[token_of]]
            templates = [(torch.float8_e4m3fn, (hidden,)), (scales.dtype, tuple(scales.shape[1:]))]
        else:
            payload = [x[token_of]]
            templates = [(x.dtype, (hidden,))]
        payload += [token_of.to(torch.int32).unsqueeze(1), (expert % num_local_experts).to(torch.int32).unsqueeze(1)]
        templates += [(torch.int32, (1,)), (torch.int32, (1,))]
        packed, widths = _pack_rows(payload)
        fields = _unpack_rows(self._all_to_all_rows(packed, send_counts, recv_counts), widths, templates)
        recv_token, recv_local = fields[-2].view(-1).long(), fields[-1].view(-1).long()
        src_rank = torch.repeat_interleave(
            torch.arange(num_ranks, device=device), torch.tensor(recv_counts, device=device)
        )
        num_recv = recv_token.numel()

        # Slot of each received message inside its expert: its rank among earlier arrivals for that expert.
        by_expert = torch.argsort(recv_local, stable=True)
        recv_count = torch.bincount(recv_local, minlength=num_local_experts)
        if int(recv_count.max().item() if num_recv else 0) > num_slots:
            raise RuntimeError(
                "low_latency_dispatch: a local expert received more tokens than "
                f"num_ranks * num_max_dispatch_tokens_per_rank = {num_slots}"
            )
        group_start = torch.cumsum(recv_count, 0) - recv_count
        slot = torch.empty(num_recv, dtype=torch.long, device=device)
        slot[by_expert] = torch.arange(num_recv, device=device) - group_start[recv_local[by_expert]]
        flat_slot = recv_local * num_slots + slot

        pair_count = torch.bincount(recv_local * num_ranks + src_rank, minlength=num_local_experts * num_ranks)
        pair_count = pair_count.view(num_local_experts, num_ranks)
        pair_begin = torch.cumsum(pair_count, 1) - pair_count
        layout_range = (pair_begin.to(torch.int64) << 32) | pair_count.to(torch.int64)
        src_info = torch.full((num_local_experts * num_slots,), -1, dtype=torch.int32, device=device)
        src_info[flat_slot] = recv_token.to(torch.int32)
        src_info = src_info.view(num_local_experts, num_slots)

        received = fields[:-2]

        recv_count = recv_count.to(torch.int32)
        recv_x, recv_scales = allocate_dispatch_outputs(
            num_local_experts, num_slots, hidden, use_fp8, use_ue8m0, device
        )
        recv_count_out = torch.empty((num_local_experts,), dtype=torch.int32, device=device)

        def receive() -> None:
            recv_count_out.copy_(recv_count)
            if cumulative_stats is not None:
                cumulative_stats.add_(recv_count)
            recv_x.view(torch.uint8).zero_()
            recv_x.view(num_local_experts * num_slots, hidden)[flat_slot] = received[0]
            if recv_scales is not None:
                recv_scales.zero_()
                e, s = flat_slot // num_slots, flat_slot % num_slots
                recv_scales[e, s] = received[1]

        state = ReferenceLowLatencyState(token_of, k_of, send_counts, recv_counts, flat_slot)
        handle = args.make_handle(src_info, layout_range, state)
        return handle, (recv_x, recv_scales, recv_count_out), receive

    def low_latency_combine(self, args: LowLatencyCombineArgs):
        """Weighted sum back on the source ranks; returns ``(out, receive)``, where ``receive()`` writes ``out [N, H]``
        (``args.out``, else a new bfloat16 tensor). ``wait_stats`` (``combine_wait_recv_cost_stats``) is left as it
        is (0 added), as in ``low_latency_dispatch``."""
        x, topk_idx, topk_weights, handle, out = args.x, args.topk_idx, args.topk_weights, args.handle, args.out
        state: ReferenceLowLatencyState = handle.backend_state
        hidden = x.size(-1)
        rows = x.reshape(-1, hidden)[state.recv_flat_slot]
        packed, widths = _pack_rows([rows])
        (back,) = _unpack_rows(
            self._all_to_all_rows(packed, state.recv_counts, state.send_counts), widths, [(x.dtype, (hidden,))]
        )
        num_tokens, num_topk = topk_idx.shape
        per_entry = torch.zeros((num_tokens, num_topk, hidden), dtype=torch.float32, device=x.device)
        per_entry[state.send_token, state.send_k] = back.float()
        valid = topk_idx >= 0
        if out is None:
            out = torch.empty((num_tokens, hidden), dtype=torch.bfloat16, device=x.device)

        def receive() -> None:
            acc = torch.zeros((num_tokens, hidden), dtype=torch.float32, device=x.device)
            for k in range(num_topk):
                weighted = topk_weights[:, k : k + 1].float() * per_entry[:, k]
                acc = torch.where(valid[:, k : k + 1], acc + weighted, acc)
            out.copy_(acc.to(out.dtype))

        return out, receive

    def take_low_latency_error(self) -> Optional[tuple]:
        """None: the reference checks ``topk_idx`` on the host before it runs (``checks_topk_idx_on_device``)."""
        return None

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> None:
        """Nothing to clean: the reference keeps no signals between calls."""

    def logfmt_roundtrip(self, x: torch.Tensor, inplace: bool = False) -> torch.Tensor:
        """``x`` encoded to LogFMT-10 and decoded (``ep_dispatcher.logfmt``); written back into ``x`` if ``inplace``."""
        y = logfmt_roundtrip(x)
        return x.copy_(y) if inplace else y

    def low_latency_combine_buffer(self, half: int, shape: Tuple[int, int, int], device: torch.device) -> torch.Tensor:
        """The zero-copy combine input of buffer half ``half`` (persistent across calls)."""
        buf = self._ll_combine_buffers.get(half)
        if buf is None or tuple(buf.shape) != shape or buf.device != device:
            buf = torch.empty(shape, dtype=torch.bfloat16, device=device)
            self._ll_combine_buffers[half] = buf
        return buf
