"""The engines' buffer sizes in Python, for a machine without the extension (the reference backend).

Where ``ep_dispatcher._C`` is built, ``config.py`` reads the sizes from the kernels' own layout structs
(``_C.internode_layout`` / ``_C.low_latency_layout``, the ``make_layout`` functions of csrc/kernels/internode.cu and
low_latency.cu): that is the one source. These copies of the arithmetic serve only where it is not, so that a
reference ``Buffer`` sizes and checks its arguments exactly as a CUDA one would; tests/test_config.py checks that
they equal the extension's layouts.
"""

from __future__ import annotations

from ..config import (
    BUFFER_ALIGNMENT,
    FP8_GROUP_SIZE,
    INTERNODE_MAX_LOCAL_EXPERTS,
    NUM_LOW_LATENCY_BUFFERS,
    NUM_MAX_TOPK,
    _align,
)

LOW_LATENCY_HEADER_BYTES = 16  # metadata in front of each low-latency message (source token, slot)


def internode_layout_bytes(hidden_bytes: int, num_ranks: int, num_ranks_per_node: int, max_tokens: int) -> int:
    """Bytes of the internode engine's symmetric buffer for ``max_tokens`` tokens per rank.

    Signal part (64-bit barrier counters [R], double-buffered count slots [2][R][R + N + 1 + 1024] int32, staging
    [R][R + N + 1 + 1024]), then the larger of the dispatch part (staged messages [T], received messages [N][T],
    final rows [R * T]) and the combine part (node rows [R * T], partials [N][T], staged partials [N][T]).
    """
    R, P, T = num_ranks, num_ranks_per_node, max_tokens
    N = R // P
    slot = R + N + 1 + INTERNODE_MAX_LOCAL_EXPERTS
    scale_max = (hidden_bytes // 2 + FP8_GROUP_SIZE - 1) // FP8_GROUP_SIZE * 4
    msg = _align(hidden_bytes + scale_max + 8 + NUM_MAX_TOPK * 12 + 4 + R * 4, 16)
    recv_row = hidden_bytes + scale_max + NUM_MAX_TOPK * 12 + 4
    comb = _align(hidden_bytes + NUM_MAX_TOPK * 4, 16)
    data = _align(R * 8) + _align(2 * R * slot * 4) + _align(R * slot * 4)
    dispatch = _align(T * msg) + _align(N * T * msg) + _align(R * T * recv_row + 5 * BUFFER_ALIGNMENT)
    combine = _align(R * T * comb) + 2 * _align(N * T * comb)
    return data + max(dispatch, combine)


def low_latency_layout_bytes(max_tokens: int, hidden: int, num_ranks: int, num_experts: int) -> int:
    """Bytes of the low-latency buffer (both halves).

    Per half: the send side holds one staged copy per token (dispatch) or per (expert, slot) (combine); the receive
    side a slot for every (expert, source rank, token); the signals are the dispatch counts and combine flags (8 bytes
    per expert each) and one receive ack per rank. A dispatch message is the header and the larger of the BF16 and
    the FP8 + fp32 scales payloads; a combine message the header and a BF16 row.
    """
    dispatch_msg = _align(LOW_LATENCY_HEADER_BYTES + max(hidden * 2, hidden + hidden // FP8_GROUP_SIZE * 4), 16)
    combine_msg = _align(LOW_LATENCY_HEADER_BYTES + hidden * 2, 16)
    send = max(max_tokens * dispatch_msg, num_experts * max_tokens * combine_msg)
    recv = num_experts * max_tokens * max(dispatch_msg, combine_msg)
    signals = num_experts * 8 * 2 + num_ranks * 8
    return NUM_LOW_LATENCY_BUFFERS * (_align(send) + _align(recv) + _align(signals))
