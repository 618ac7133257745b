"""Per-128-channel FP8 (e4m3) casts: the exact arithmetic every engine must reproduce bit for bit.

For each token and each group of 128 channels:
    amax  = max(max |x_g|, 1e-4)              (fp32; the floor keeps all-zero groups finite)
    scale = amax / 448                          (fp32 division; 448 = largest finite e4m3 value)
    scale = 2 ** ceil(log2(scale))              (only with round_scale: a power of two, exact to invert)
    q     = e4m3(x_g / scale)                   (fp32 division, round-to-nearest-even)
With ``use_ue8m0`` the (power-of-two) scales are stored as their 8-bit biased exponents, four groups
packed little-endian into one int32 (group 4*j+b in byte b of word j).
"""

from __future__ import annotations

import torch

FP8_GROUP_SIZE = 128  # channels that share one scale (the DeepSeek-V3 / DeepGEMM block size)
FP8_E4M3_MAX = 448.0  # largest finite float8_e4m3fn value
AMAX_FLOOR = 1e-4  # avoids a zero scale (and inf/NaN on division) for all-zero groups
UE8M0_GROUPS_PER_WORD = 4  # four 8-bit exponents per int32


def round_scale_to_pow2(scale: torch.Tensor) -> torch.Tensor:
    """2 ** ceil(log2(scale)) for positive fp32 ``scale``, computed exactly (no log/exp rounding)."""
    mantissa, exponent = torch.frexp(scale)  # scale = mantissa * 2**exponent, mantissa in [0.5, 1)
    exponent = exponent - (mantissa == 0.5).to(exponent.dtype)  # exact powers of two stay as they are
    return torch.ldexp(torch.ones_like(scale), exponent)


def pack_ue8m0(scale: torch.Tensor) -> torch.Tensor:
    """Power-of-two fp32 scales ``[..., G]`` (G % 4 == 0) -> packed biased exponents ``[..., G/4]`` int32."""
    exponent_bytes = ((scale.view(torch.int32) >> 23) & 0xFF).to(torch.uint8).contiguous()
    return exponent_bytes.view(torch.int32)


def unpack_ue8m0(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_ue8m0`: ``[..., G/4]`` int32 -> fp32 scales ``[..., G]``."""
    exponent_bytes = packed.contiguous().view(torch.uint8).to(torch.int32)
    return (exponent_bytes << 23).view(torch.float32)


def per_token_cast_to_fp8(x: torch.Tensor, round_scale: bool = False, use_ue8m0: bool = False):
    """Cast ``x: [num_tokens, hidden]`` (bf16/fp32, hidden % 128 == 0) to FP8 with per-128-channel scales.

    Returns ``(x_fp8 [num_tokens, hidden] float8_e4m3fn, scales)`` where ``scales`` is
    ``[num_tokens, hidden/128] float32``, or ``[num_tokens, hidden/512] int32`` (packed UE8M0) when
    ``use_ue8m0`` (which implies ``round_scale``).
    """
    if x.dim() != 2 or x.size(1) % FP8_GROUP_SIZE != 0:
        raise ValueError(
            f"x: expected [num_tokens, hidden] with hidden % {FP8_GROUP_SIZE} == 0, got shape {tuple(x.shape)}"
        )
    num_tokens, hidden = x.shape
    groups = x.float().view(num_tokens, hidden // FP8_GROUP_SIZE, FP8_GROUP_SIZE)
    amax = groups.abs().amax(dim=-1).clamp(min=AMAX_FLOOR)
    # A tensor divisor: torch divides a CUDA tensor by a Python scalar as a multiply by its reciprocal, which can
    # differ in the last bit from the true quotient that CPU tensors and the kernels compute.
    scale = amax / torch.full_like(amax, FP8_E4M3_MAX)
    if round_scale or use_ue8m0:
        scale = round_scale_to_pow2(scale)
    x_fp8 = (groups / scale.unsqueeze(-1)).to(torch.float8_e4m3fn).view(num_tokens, hidden)
    if use_ue8m0:
        if hidden % (FP8_GROUP_SIZE * UE8M0_GROUPS_PER_WORD) != 0:
            raise ValueError(f"x: use_ue8m0 needs hidden % 512 == 0, got hidden={hidden}")
        return x_fp8, pack_ue8m0(scale)
    return x_fp8, scale


def per_token_cast_back(x_fp8: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Dequantise ``(x_fp8 [N, H], scales [N, H/128] fp32 or [N, H/512] int32 UE8M0)`` -> fp32 ``[N, H]``."""
    if scales.dtype == torch.int32:
        scales = unpack_ue8m0(scales)
    num_tokens, hidden = x_fp8.shape
    groups = x_fp8.float().view(num_tokens, hidden // FP8_GROUP_SIZE, FP8_GROUP_SIZE)
    return (groups * scales.unsqueeze(-1)).view(num_tokens, hidden)
