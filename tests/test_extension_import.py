"""The compiled extension ep_dispatcher._C imports and answers without a GPU (CPU-only CI).

When EP_DISPATCHER_REQUIRE_EXTENSION=1 (CI sets it) a missing extension is a failure, not a skip, so a broken build
can never pass silently.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

REQUIRE_EXTENSION = os.environ.get("EP_DISPATCHER_REQUIRE_EXTENSION") == "1"


def _extension_module():
    # find_spec imports the ep_dispatcher package itself: if that is broken the test errors, as it should.
    if importlib.util.find_spec("ep_dispatcher._C") is None:
        if REQUIRE_EXTENSION:
            pytest.fail(
                "EP_DISPATCHER_REQUIRE_EXTENSION=1 but ep_dispatcher._C was not built "
                "(see the 'ep_dispatcher setup:' line of pip install -v for why)"
            )
        pytest.skip("ep_dispatcher._C is not built (pure-Python install)")
    return importlib.import_module("ep_dispatcher._C")


def test_extension_imports_without_gpu():
    extension = _extension_module()
    for name in ("get_dispatch_layout", "has_nvshmem", "nvshmem_get_unique_id", "version", "cuda_arch_list"):
        assert callable(getattr(extension, name)), name


def test_build_information():
    extension = _extension_module()
    assert isinstance(extension.has_nvshmem(), bool)
    arch_list = extension.cuda_arch_list()
    assert "90" in arch_list, arch_list
    assert all(re.fullmatch(r"\d+[af]?", arch) for arch in arch_list.split(";")), arch_list
    import ep_dispatcher

    expected_version = getattr(ep_dispatcher, "__version__", None)
    if expected_version is not None:
        # A mismatch means a stale extension: rebuild after changing the version.
        assert extension.version() == expected_version


def test_nvshmem_unique_id_or_clear_error():
    extension = _extension_module()
    if extension.has_nvshmem():
        unique_id = extension.nvshmem_get_unique_id()
        assert isinstance(unique_id, bytes) and len(unique_id) > 0
    else:
        with pytest.raises(RuntimeError, match="ep_dispatcher was built without NVSHMEM"):
            extension.nvshmem_get_unique_id()


def test_timeout_report_is_empty_until_a_wait_times_out():
    # The GPU timeout test (tests/gpu/test_timeout_gpu.py) checks a filled record; here no kernel ever waited.
    assert _extension_module().timeout_report() == ""


def test_cpu_tensor_is_rejected_with_value_error():
    extension = _extension_module()
    topk_idx = torch.zeros(4, 2, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"get_dispatch_layout: topk_idx must be a CUDA tensor, got device cpu"):
        extension.get_dispatch_layout(topk_idx, 8, 2, 8)


@pytest.mark.skipif(shutil.which("readelf") is None, reason="readelf not installed")
def test_extension_does_not_link_libcuda():
    # libcuda comes with the GPU driver; linking it would make the import fail on driverless machines (CI).
    extension = _extension_module()
    dynamic_section = subprocess.run(
        ["readelf", "-d", extension.__file__], check=True, capture_output=True, text=True
    ).stdout
    needed = re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", dynamic_section)
    assert needed, dynamic_section
    assert not [lib for lib in needed if lib.startswith("libcuda.so")], needed


@pytest.mark.parametrize("value, expected", [(None, False), ("0", False), ("yes", False), ("1", True)])
def test_pending_kernels_switch_is_off_unless_asked_for(value, expected):
    """Kernels that have not yet run on a GPU replace their predecessors only with EP_DISPATCHER_PENDING_KERNELS=1
    exactly (kernels/pending_kernels.h); the C++ side reads it once per process, so each case is a fresh process."""
    _extension_module()
    env = {k: v for k, v in os.environ.items() if k != "EP_DISPATCHER_PENDING_KERNELS"}
    if value is not None:
        env["EP_DISPATCHER_PENDING_KERNELS"] = value
    code = "import ep_dispatcher._C as C; print(C.pending_kernels_enabled())"
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(expected)
