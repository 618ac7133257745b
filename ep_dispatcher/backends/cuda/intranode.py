"""The intranode engine: dispatch and combine inside one NVLink domain, over CUDA-IPC buffers.

Every token is written once, straight into the receiver's output tensors, which own regions of its receive pool
(csrc/kernels/intranode.cuh and docs/architecture.md explain the flow).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch
import torch.distributed as dist

from ... import _C
from ...expert_major import ExpertMajorLayout
from ...handles import DispatchHandle
from ..base import CombineArgs, DispatchArgs
from .common import COMBINE_DTYPES, EngineContext, check_engine_limit, engine_dispatch_handle, kernel_num_sms


@dataclass(frozen=True)
class IntranodeState:
    """What an intranode dispatch keeps for its cached dispatches and combine (``DispatchHandle.backend_state``).

    count_matrix: ``[num_ranks, num_ranks] int32`` device tensor, entry ``[i, j]`` = tokens rank ``i`` sends to rank
        ``j``; count_matrix_host: the same on the host, ``None`` with ``num_worst_tokens`` (no host sync);
    send_pos: ``[num_tokens, num_ranks] int32``, each token's row among this rank's rows at each destination, ``-1``
        where it is not sent; sent_rows, most_sent: what the combine needs to size its receive region (``most_sent``
        is the most rows any rank gets back when the host knows the counts).
    expert_pairs, expert_table: only from the fused expert-major dispatch (``dispatch_expert_major``), what its cached
        dispatch reuses: ``[2, num_tokens, num_topk] int32`` (expert-major row at the destination, destination rank;
        ``-1`` where the pair is not sent) and the count exchange's ``int32`` expert table (column totals, slot bases,
        this rank's received pairs per local expert: ``csrc/kernels/intranode.cuh``, ``notify``).
    """

    count_matrix: torch.Tensor
    count_matrix_host: Optional[torch.Tensor]
    send_pos: torch.Tensor
    sent_rows: object
    most_sent: int
    expert_pairs: Optional[torch.Tensor] = None
    expert_table: Optional[torch.Tensor] = None


# The outputs of the fresh dispatch bindings (csrc/intranode_bindings.cpp), in order, by the names
# IntranodeEngine._dispatch_outputs reads; the last output (receive-pool bytes needed) is left unnamed.
_FRESH_OUTPUTS = (
    "recv_x recv_scales recv_topk_idx recv_topk_weights recv_src_idx send_pos count_matrix rank_prefix_matrix "
    "per_expert count_matrix_host per_expert_list rows_out sent_rows most_sent"
).split()
_EXPERT_MAJOR_OUTPUTS = (
    "recv_x recv_scales recv_topk_idx recv_topk_weights recv_src_idx row_map row_pair send_pos expert_pairs "
    "count_matrix rank_prefix_matrix per_expert expert_table count_matrix_host per_expert_list rows_out num_rows "
    "sent_rows most_sent"
).split()


class IntranodeEngine:
    """This rank's CUDA-IPC buffer (signal area + receive pool) and the calls that run on it."""

    combine_dtypes = COMBINE_DTYPES

    def __init__(self, ctx: EngineContext, num_bytes: int):
        check_engine_limit("num_ranks", ctx.num_ranks, _C.INTRANODE_MAX_RANKS, "intranode")
        self.ctx = ctx
        self.ipc: "_C.IpcBuffer" = self._open_ipc(num_bytes)

    def made(self, state: object) -> bool:
        """Whether a handle with this ``backend_state`` came from this engine."""
        return isinstance(state, IntranodeState)

    def _open_ipc(self, num_bytes: int) -> "_C.IpcBuffer":
        """This rank's CUDA-IPC buffer (signal area + receive pool of ``num_bytes``), with every peer's mapped
        (collective)."""
        ipc = _C.IpcBuffer(self.ctx.rank, self.ctx.num_ranks, num_bytes, torch.cuda.current_device())
        handles: List[bytes] = [b""] * self.ctx.num_ranks
        dist.all_gather_object(handles, ipc.ipc_handle(), group=self.ctx.group)
        ipc.open_peers(handles)
        dist.barrier(group=self.ctx.group)  # every rank has mapped every buffer before anyone writes
        return ipc

    def _grow_receive_pool(self, needed_bytes: int) -> None:
        """Replace the receive pool by one of twice ``needed_bytes`` (room for one call's outputs and the next call).

        Collective, and every rank calls it at the same point: the need comes from the count matrix, which all ranks
        share. Outputs still alive in the old pool move out of it (copied, their storage re-pointed) before it goes.
        """
        old = self.ipc
        self.ipc = self._open_ipc(max(2 * int(needed_bytes), old.data_bytes))
        old.destroy()

    def destroy(self) -> None:
        self.ipc.destroy()
        self.ipc = None

    def dispatch(self, args: DispatchArgs):
        # One C++ entry: send positions and content checks on the device, the count exchange, the host's wait for the
        # counts (host-mapped memory, no stream sync; none with num_worst_tokens), the data kernels.
        # A call whose rows do not fit in some rank's empty pool, or do not fit next to the live outputs while the
        # group's smallest pool holds less than twice them, returns the size it needs, on every rank alike (same
        # counts, same smallest pool): the pools grow together and the call runs again (once: the grown pool holds it).
        def run():
            return _C.intranode_dispatch_fresh(
                *self._fresh_inputs(args),
                args.num_tokens_per_expert,
                args.num_experts or 0,
                args.expert_alignment,
                args.num_worst_tokens,
                kernel_num_sms(args.config),
                self.ctx.timeout_ns,
            )

        result, _ = self._dispatch_outputs(args, self._run_growing(run), _FRESH_OUTPUTS)
        return result

    def _dispatch_outputs(self, args: DispatchArgs, outputs: Sequence, names: Sequence[str]):
        """What both fresh dispatches return: ``((recv_x, recv_scales, recv_topk_idx, recv_topk_weights,
        per_expert_list, handle), outputs by name)``; the handle holds this engine's state (``expert_pairs`` /
        ``expert_table`` only from the fused expert-major dispatch)."""
        out = dict(zip(names, outputs[:-1], strict=True))  # the last (receive-pool bytes needed) is 0 by now
        state = IntranodeState(
            count_matrix=out["count_matrix"],
            count_matrix_host=out["count_matrix_host"],
            send_pos=out["send_pos"],
            sent_rows=out["sent_rows"],
            most_sent=out["most_sent"],
            expert_pairs=out.get("expert_pairs"),
            expert_table=out.get("expert_table"),
        )
        handle = engine_dispatch_handle(
            args,
            self.ctx.rank,
            self.ctx.num_ranks_per_node,
            out["count_matrix"],
            out["recv_src_idx"],
            out["rows_out"],
            out["per_expert"],
            state,
            rank_prefix_matrix=out["rank_prefix_matrix"],
        )
        recv = (out["recv_x"], out["recv_scales"], out["recv_topk_idx"], out["recv_topk_weights"])
        return (*recv, out["per_expert_list"], handle), out

    def _fresh_inputs(self, args: DispatchArgs) -> tuple:
        """The leading arguments of both fresh dispatch bindings; read per run, since growing replaces ``self.ipc``."""
        return (
            self.ipc,
            args.x,
            args.x_scales,
            args.topk_idx,
            args.topk_weights,
            args.is_token_in_rank,
            args.num_tokens_per_rank,
        )

    def _run_growing(self, run):
        """``run()`` (a fresh dispatch binding); if it returns a pool size it needs (its last output, the same on every
        rank), the pools grow together and it runs again (once: the grown pool holds it)."""
        outputs = run()
        if outputs[-1] > 0:
            self._grow_receive_pool(outputs[-1])
            outputs = run()
        if outputs[-1] > 0:  # never expected: the outputs of a call that did not run must not be returned
            raise RuntimeError(f"intranode dispatch: {outputs[-1]} receive-pool bytes needed after growing the pool")
        return outputs

    def dispatch_expert_major(self, args: DispatchArgs):
        """Fused expert-major dispatch (docs/fused_permute.md): one C++ entry; each (token, local expert) row is written
        straight into its expert-major slot on the receiver, and the layout (``row_map``, ``row_pair``) is written by
        the senders too. The count exchange's wait is the only host wait. Same outputs as
        ``expert_major.to_expert_major`` applied to ``dispatch``; ``num_tokens_per_expert`` is not needed (the kernel
        counts the pairs it places)."""
        outputs = self._run_growing(
            lambda: _C.intranode_dispatch_expert_major(
                *self._fresh_inputs(args),
                args.num_experts,
                args.expert_alignment,
                kernel_num_sms(args.config),
                self.ctx.timeout_ns,
            )
        )
        (*result, handle), out = self._dispatch_outputs(args, outputs, _EXPERT_MAJOR_OUTPUTS)
        layout = ExpertMajorLayout(
            row_map=out["row_map"],
            row_pair=out["row_pair"],
            num_rows=out["num_rows"],
            num_topk=args.topk_idx.size(1),
            expert_alignment=args.expert_alignment,
        )
        return (*result, handle.with_expert_major(layout))

    def cached_dispatch_expert_major(self, x, x_scales, handle: DispatchHandle, config=None):
        """Cached fused expert-major dispatch (combine's backward): the data phase only, each pair to the row the fresh
        call placed it in (``IntranodeState.expert_pairs``). Only for handles ``dispatch_expert_major`` made."""
        state: IntranodeState = handle.backend_state
        return _C.intranode_dispatch_expert_major_cached(
            self.ipc,
            x,
            x_scales,
            state.expert_pairs,
            handle.num_recv_tokens_per_expert,
            state.expert_table,
            handle.expert_major.num_rows,
            kernel_num_sms(config),
            self.ctx.timeout_ns,
        )

    def cached_dispatch(self, x, x_scales, handle: DispatchHandle, config=None):
        state: IntranodeState = handle.backend_state
        num_sms = kernel_num_sms(config)
        recv_x, recv_scales, _, _, _ = _C.intranode_dispatch(
            self.ipc,
            x,
            x_scales,
            None,
            None,
            1,
            handle.is_token_in_rank,
            state.send_pos,
            state.count_matrix,
            handle.num_recv_rows,
            num_sms,
            self.ctx.timeout_ns,
            False,  # cached: x and scales only
        )
        return recv_x, recv_scales

    def combine_expert_major(self, args: CombineArgs):
        """Fused expert-major combine: ``x [M, hidden]`` expert-major rows of a handle ``dispatch_expert_major`` made.
        Each rank sums a received token's rows (``handle.expert_major.row_map``, ascending, fp32, one rounding: as
        ``expert_major.unpermute_sum``) while it pushes the token back to its source, its own tokens included; the
        sources' reduce is the normal combine's. Always pushed, also for an ``x`` that lies in the receive pool."""
        return self.combine(args, row_map=args.handle.expert_major.row_map)

    def combine(self, args: CombineArgs, row_map: Optional[torch.Tensor] = None):
        x, handle, topk_weights, bias = args.x, args.handle, args.topk_weights, args.bias
        state: IntranodeState = handle.backend_state
        num_sms = kernel_num_sms(args.config)
        # Every rank checks the most rows any rank gets back (all know the count matrix), so all grow together.
        num_topk = 0 if topk_weights is None else topk_weights.size(1)
        row_bytes = x.size(1) * x.element_size()
        # With num_worst_tokens the host has no counts (most_sent is then a bound of this rank's alone): no growth.
        known = state.count_matrix_host is not None
        if known and state.most_sent > self.ipc.combine_capacity(row_bytes, num_topk):
            self._grow_receive_pool(_C.intranode_combine_bytes(state.most_sent, row_bytes, num_topk))
        bias0 = bias[0] if len(bias) > 0 else None
        bias1 = bias[1] if len(bias) > 1 else None
        return _C.intranode_combine(
            self.ipc,
            x,
            topk_weights,
            bias0,
            bias1,
            handle.is_token_in_rank,
            state.send_pos,
            state.count_matrix,
            handle.num_tokens,
            state.sent_rows,
            num_sms,
            self.ctx.timeout_ns,
            row_map,
        )
