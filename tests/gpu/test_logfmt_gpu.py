"""ep_dispatcher._C.logfmt_roundtrip (csrc/kernels/logfmt.cu) is bit-exact with ep_dispatcher.logfmt (the reference).
The combine with use_logfmt=True on the CUDA backend runs in DeepEP's own test_low_latency.py --use-logfmt
(tests/gpu/deepep_tests).

Bit-exact is the claim: both follow the same float64 formulas operation by operation; a last-bit difference between
CUDA's and libm's float64 log2/exp2 could move a value across a floor or a BF16 rounding boundary (about 1e-13 per
element, so never in these sizes), which this test would report with the element.
"""

from __future__ import annotations

import pytest
import torch

from tests.gpu.common import require_extension

pytestmark = pytest.mark.gpu
_C = require_extension()

from ep_dispatcher.logfmt import logfmt_roundtrip  # noqa: E402
from tests.poison import poison_allocator  # noqa: E402


def _inputs(seed: int):
    g = torch.Generator().manual_seed(seed)
    cases = []
    for scale in (0.5, 0.1, 1e-3, 3.0):
        x = torch.randn((37, 7168), generator=g) * scale
        x[0, :128] = 0  # an all-zero group: stays as it is
        x[1, 128:256] = 0.125  # a constant group: stays BF16
        x[2, 300] = 0  # one zero in a cast group
        x[3, 400] = -0.0
        cases.append(x.bfloat16())
    cases.append((torch.randn((4, 3, 256), generator=g) * 0.05).bfloat16())  # any leading shape
    return cases


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_kernel_is_bit_exact_with_the_reference(seed):
    for x in _inputs(seed):
        expected = logfmt_roundtrip(x)  # CPU reference
        poison_allocator(x.numel() * 2)
        got = _C.logfmt_roundtrip(x.cuda()).cpu()
        mismatch = (got.view(torch.int16) != expected.view(torch.int16)).nonzero()
        assert mismatch.numel() == 0, f"{mismatch.size(0)} elements differ, first at {mismatch[0].tolist()}"
        inplace = x.cuda()
        assert _C.logfmt_roundtrip(inplace, True).data_ptr() == inplace.data_ptr()
        assert torch.equal(inplace.cpu().view(torch.int16), expected.view(torch.int16))


def test_kernel_rejects_bad_input():
    with pytest.raises(ValueError, match="x: expected dtype bfloat16"):
        _C.logfmt_roundtrip(torch.zeros((2, 128), device="cuda"))
    with pytest.raises(ValueError, match="x: expected the last dimension to be a multiple of 128"):
        _C.logfmt_roundtrip(torch.zeros((2, 100), dtype=torch.bfloat16, device="cuda"))
    with pytest.raises(ValueError, match="x: expected a contiguous tensor"):
        _C.logfmt_roundtrip(torch.zeros((256, 256), dtype=torch.bfloat16, device="cuda").t())
