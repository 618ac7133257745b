"""Argument checks used at the API edge; every message names the argument, what it got and what it expects."""

from __future__ import annotations

from typing import Iterable, Optional, Sequence, Tuple, Union

import torch

ShapeSpec = Sequence[Optional[int]]  # None = any size in that dimension


def _fmt_shape(shape: ShapeSpec) -> str:
    return "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"


def _shape_matches(got: torch.Size, shape: ShapeSpec) -> bool:
    if len(got) != len(shape):
        return False
    for want, size in zip(shape, got):
        if want is not None and want != size:
            return False
    return True


def check_tensor(
    name: str,
    t,
    *,
    dtypes: Union[torch.dtype, Iterable[torch.dtype], None] = None,
    shape: Optional[ShapeSpec] = None,
    device: Optional[torch.device] = None,
    contiguous: bool = True,
) -> torch.Tensor:
    """Raise ``TypeError``/``ValueError`` unless ``t`` is a tensor with the given dtype(s), shape and device.

    On every hot-path call (several per dispatch or combine), so the passing case is kept to plain comparisons: no
    generator, no tuple built per call for a single dtype."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if dtypes is not None:
        if isinstance(dtypes, torch.dtype):
            if t.dtype != dtypes:
                raise TypeError(f"{name}: expected dtype {dtypes}, got {t.dtype}")
        else:
            allowed = tuple(dtypes)  # once: an iterator is consumed by the test, and the message names them too
            if t.dtype not in allowed:
                want = " or ".join(str(d) for d in allowed)
                raise TypeError(f"{name}: expected dtype {want}, got {t.dtype}")
    # Exact equality first (one C-level comparison, the usual case), the wildcard match only when it fails.
    if shape is not None and t.shape != shape and not _shape_matches(t.shape, shape):
        raise ValueError(f"{name}: expected shape {_fmt_shape(shape)}, got {list(t.shape)}")
    if device is not None and t.device != device:
        raise ValueError(f"{name}: expected a tensor on {device}, got one on {t.device}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous tensor (call .contiguous()), got strides {t.stride()}")
    return t


def check_int(name: str, value, *, minimum: Optional[int] = None, maximum: Optional[int] = None) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__} {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name}: expected >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name}: expected <= {maximum}, got {value}")
    return value


def is_capturing() -> bool:
    """True while a CUDA graph is being captured: value checks that read device memory must be skipped."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def check_topk_idx_range(topk_idx: torch.Tensor, num_experts: int, distinct: bool = False) -> None:
    """Entries must be in ``[-1, num_experts)`` and, with ``distinct``, no token may list an expert twice
    (low-latency slots hold one entry per token and expert; -1 may repeat). One host sync on a GPU for all of it
    (skipped under graph capture)."""
    if topk_idx.numel() == 0 or is_capturing():
        return
    facts = list(torch.aminmax(topk_idx))
    check_repeats = distinct and topk_idx.size(1) > 1
    if check_repeats:
        ordered = topk_idx.sort(dim=1).values
        repeated = (ordered[:, 1:] == ordered[:, :-1]) & (ordered[:, 1:] >= 0)
        facts.append(repeated.any().to(topk_idx.dtype))
    values = torch.stack(facts).tolist()  # the one host sync
    lo, hi = values[0], values[1]
    if lo < -1 or hi >= num_experts:
        raise ValueError(f"topk_idx: expected entries in [-1, {num_experts}) (-1 = no expert), got min {lo}, max {hi}")
    if check_repeats and values[2]:
        token = int(repeated.any(dim=1).nonzero()[0, 0])
        raise ValueError(
            f"topk_idx: token {token} lists an expert more than once ({topk_idx[token].tolist()}); "
            "low-latency calls expect distinct experts per token (-1 may repeat). Stricter than DeepEP on purpose "
            "(its kernels would give the expert the token twice and combine would count it twice): mask repeats "
            "with -1, e.g. as torch.topk's indices never repeat"
        )


# Codes of the low-latency kernels' error record (csrc/kernels/low_latency.cuh, ErrorCode).
LL_ERROR_DISPATCH_RANGE, LL_ERROR_DISPATCH_REPEAT, LL_ERROR_COMBINE_RANGE = 1, 2, 3
_INT32_LIMITS = (-(2**31), 2**31 - 1)  # the record holds the bad value as int32, clamped


def tokens_per_rank_mismatch(counts: Sequence[int], given: Sequence[int]) -> Optional[ValueError]:
    """The error for a ``num_tokens_per_rank`` (``given``) that differs from ``is_token_in_rank.sum(0)`` (``counts``),
    or None when they agree. One message for the reference and the internode engine (the intranode engine raises
    its own from C++, with the same first clause after the name: entry, value, what ``is_token_in_rank`` sends)."""
    counts, given = [int(c) for c in counts], [int(g) for g in given]
    if counts == given:
        return None
    rank = next(r for r, (c, g) in enumerate(zip(counts, given)) if c != g)
    return ValueError(
        f"num_tokens_per_rank: expected is_token_in_rank.sum(0) = {counts}, got {given}: entry {rank} is "
        f"{given[rank]} but is_token_in_rank sends {counts[rank]} tokens to rank {rank}; pass the counts "
        "get_dispatch_layout returned with it"
    )


def low_latency_topk_error(code: int, token: int, k: int, value: int, num_experts: int) -> ValueError:
    """The ``ValueError`` for a bad ``topk_idx`` entry that a low-latency kernel found (and skipped) on the GPU.

    The kernels check on the device instead of syncing the host; the host reads their record without a sync after
    its next low-latency launch, so the error names an entry of an earlier call (that call's outputs miss the entry).
    """
    where = f"token {token}, k {k}"
    found = (
        "; found on the GPU by the low-latency {call} kernel, which skipped the entry (raised at the first "
        "low-latency call or hook after it ran; its outputs lack that entry)"
    )
    if code == LL_ERROR_DISPATCH_REPEAT:
        return ValueError(
            f"topk_idx: token {token} lists an expert more than once (expert {value} again at k {k}); "
            "low-latency calls expect distinct experts per token (-1 may repeat)" + found.format(call="dispatch")
        )
    shown = f"{value} or beyond" if value in _INT32_LIMITS else str(value)
    call = "combine" if code == LL_ERROR_COMBINE_RANGE else "dispatch"
    return ValueError(
        f"topk_idx: expected entries in [-1, {num_experts}) (-1 = no expert), got {shown} ({where})"
        + found.format(call=call)
    )


SCALE_DTYPES = (torch.float32, torch.int32)  # FP8 scales: float32, or int32 holding four packed UE8M0 exponents


def split_fp8(name: str, x) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``x`` or ``(data, scales)`` -> ``(data, scales or None)``, checking the pair's form as DeepEP accepts it.

    ``data``: ``[num_tokens, hidden]`` of any dtype (float8_e4m3fn in practice) with rows of a multiple of 16 bytes.
    ``scales``: ``[num_tokens, num_scales]`` float32 or int32 (packed UE8M0), any number of columns (per-token
    ``[N, 1]``, per-128-channel ``[N, H / 128]``, ...) and any strides (column-major is what TMA/DeepGEMM callers
    pass). Scales travel with their row as opaque bytes.
    """
    if isinstance(x, (tuple, list)):
        if len(x) != 2:
            raise ValueError(f"{name}: expected a tensor or a (data, scales) pair, got {len(x)} items")
        data, scales = x
        check_tensor(f"{name}[0]", data)
        if data.dim() != 2:
            raise ValueError(f"{name}[0]: expected shape [num_tokens, hidden], got {list(data.shape)}")
        check_tensor(f"{name}[1]", scales, dtypes=SCALE_DTYPES, device=data.device, contiguous=False)
        if scales.dim() != 2 or scales.size(0) != data.size(0) or scales.size(1) < 1:
            raise ValueError(
                f"{name}[1]: expected scales of shape [num_tokens={data.size(0)}, num_scales >= 1] (float32 or int32 "
                f"packed UE8M0), got {list(scales.shape)}"
            )
        return data, scales
    check_tensor(name, x)
    return x, None


def payload_for_backend(data: torch.Tensor, scales: Optional[torch.Tensor]):
    """The form every backend's kernels take: row-major contiguous scales (a column-major scales tensor, as DeepEP's
    tests and TMA callers pass, is copied once here; it is ``num_tokens * num_scales * 4`` bytes). ``data`` is
    already contiguous (checked, as DeepEP does)."""
    return data, None if scales is None else scales.contiguous()
