"""LogFMT-10: DeepEP's 10-bit logarithmic format for low-latency combine (``use_logfmt=True``).

The format (as DeepEP v1.2.1 documents it: "LogFMT with dynamic per-64-channel cast (10 bits)"; its kernel and its
test's byte count, ``hidden * 10 / 8 + hidden / 128 * 4``, group amax/amin per 128 channels, which is what we use):
for each row and each group of ``LOGFMT_GROUP_SIZE = 128`` BF16 channels, with ``a = |x|`` and the group's
``amax``/``amin`` of ``a`` (sent as a BF16 pair, the 4 bytes per group),

    log_amax = log2(amax)
    log_amin = log_amax - 32                      if amin == 0
             = max(log2(amin), log_amax - 32)     otherwise        (32 = LOGFMT_MIN_CLIP: the range is 2^32 wide)
    cast     = log_amax < 0 and log_amin < log_amax                (else the group is sent as BF16, unchanged)
    step     = (log_amax - log_amin) / 510                         (510 = 2^9 - 2 levels between amin and amax)
    rounding = 2 - log2((1 + 2^step) / 2) / step                   (round to nearest in the linear domain)
    code     = min(floor(max((log2(a) - log_amin) / step + rounding, 0)), 511)     (9 bits + 1 sign bit)
    decoded  = 0 if code == 0 else 2^((code - 1) * step + log_amin), with x's sign

A group is cast only if all its values lie below 1 and are not all equal; zeros and values far below amin decode
to 0. The combine then sums the decoded values (fp32) instead of the BF16 ones.

Our engine applies the format as an encode/decode round trip to the combine input before sending it (the bytes on
the wire stay BF16): the receiver sums exactly the values a LogFMT receiver would decode, rounded once to BF16.
The arithmetic is float64 here and in ``csrc/kernels/logfmt.cu``: both follow these formulas operation by
operation, so they agree bit for bit except where a float64 ``log2``/``exp2`` differing in its last bit between
libm and CUDA moves a value across a floor or a BF16 rounding boundary (about 1e-13 per element).
"""

from __future__ import annotations

import torch

LOGFMT_GROUP_SIZE = 128  # channels sharing one (amax, amin) pair
LOGFMT_MIN_CLIP = 32.0  # log2 range below amax that codes can reach
LOGFMT_NUM_BITS = 10  # 1 sign bit + 9 magnitude bits
LOGFMT_NUM_VALUES = 1 << (LOGFMT_NUM_BITS - 1)  # 512 magnitude codes: 0 (zero) and 1..511
LOGFMT_THRESHOLD = 0.0  # groups with log2(amax) >= 0 (|x| >= 1) stay BF16


def logfmt_roundtrip(x: torch.Tensor) -> torch.Tensor:
    """Encode ``x`` (bfloat16, last dimension a multiple of 128) to LogFMT-10 and decode it back to bfloat16.

    Returns a new tensor of ``x``'s shape; groups that the format leaves as BF16 are copied unchanged.
    """
    if not isinstance(x, torch.Tensor) or x.dtype != torch.bfloat16:
        got = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
        raise TypeError(f"x: LogFMT takes a bfloat16 tensor, got {got}")
    if x.dim() == 0 or x.size(-1) % LOGFMT_GROUP_SIZE != 0:
        raise ValueError(
            f"x: LogFMT needs the last dimension to be a multiple of {LOGFMT_GROUP_SIZE}, got shape {list(x.shape)}"
        )
    shape = x.shape
    groups = x.reshape(-1, LOGFMT_GROUP_SIZE).double()
    negative = torch.signbit(groups)
    a = groups.abs()
    amax = a.amax(dim=1, keepdim=True)
    amin = a.amin(dim=1, keepdim=True)
    log_amax = torch.log2(amax)
    clipped = log_amax - LOGFMT_MIN_CLIP
    log_amin = torch.where(amin == 0, clipped, torch.maximum(torch.log2(amin), clipped))
    cast = (log_amax < LOGFMT_THRESHOLD) & (log_amin < log_amax)
    step = (log_amax - log_amin) / float(LOGFMT_NUM_VALUES - 2)
    step = torch.where(cast, step, torch.ones_like(step))  # groups that are not cast: any finite step
    rounding = 2.0 - torch.log2((1.0 + torch.exp2(step)) * 0.5) / step
    with torch.no_grad():
        scaled = (torch.log2(a) - log_amin) / step + rounding
        code = torch.floor(torch.clamp(scaled, min=0.0)).clamp(max=float(LOGFMT_NUM_VALUES - 1))
        magnitude = torch.where(code == 0, torch.zeros_like(a), torch.exp2((code - 1.0) * step + log_amin))
    decoded = torch.where(negative, -magnitude, magnitude)
    out = torch.where(cast, decoded, groups)
    return out.to(torch.bfloat16).view(shape)


def logfmt_wire_bytes(hidden: int) -> int:
    """Bytes one token's combine message would take in LogFMT-10 (DeepEP's test's count): 10 bits per channel plus
    one BF16 (amax, amin) pair per 128 channels."""
    return hidden * LOGFMT_NUM_BITS // 8 + hidden // LOGFMT_GROUP_SIZE * 4
