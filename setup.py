"""Build script for ep_dispatcher (metadata lives in pyproject.toml).

Install with the already-installed torch (the extension is compiled against it):

    pip install -e . --no-build-isolation

The CUDA extension ``ep_dispatcher._C`` is built only when all of these hold; otherwise the pure-Python package is
installed (the reference backend) and one line says why:
  * ``EP_DISPATCHER_NO_CUDA`` is not ``1``;
  * nvcc is found (``$CUDA_HOME/bin/nvcc``, else on ``PATH``);
  * the installed torch is a CUDA build (``torch.version.cuda`` is not None).

Build variables:
  * ``MAX_JOBS``: parallel compile jobs (default: all CPUs).
  * ``EP_DISPATCHER_CUDA_ARCHS``: ``;``-separated compute capabilities, e.g. ``"90;90a;100"`` (default ``"90"``);
    a ``+PTX`` suffix (``"90+PTX"``) also embeds PTX for that arch.
  * ``NVSHMEM_DIR``: an NVSHMEM install (``include/``, ``lib/``); default: the ``nvidia-nvshmem-cu13``/``-cu12``
    wheel. ``EP_DISPATCHER_NO_NVSHMEM=1`` builds without NVSHMEM.
libcuda is never linked: the extension must import on machines without a GPU driver; driver functions are looked up
at run time (csrc/runtime/driver_api.h).
"""

from __future__ import annotations

import glob
import importlib.util
import os
import re
import shutil
import sys

from setuptools import find_packages, setup

ROOT = os.path.dirname(os.path.abspath(__file__))
DEFAULT_CUDA_ARCHS = "90"


def _log(message: str) -> None:
    print(f"ep_dispatcher setup: {message}", flush=True)


def _read_version() -> str:
    # pyproject.toml is the single source of the version; tomllib is 3.11+, so a line match keeps 3.10 working.
    with open(os.path.join(ROOT, "pyproject.toml"), encoding="utf-8") as f:
        match = re.search(r'^version\s*=\s*"([^"]+)"', f.read(), re.MULTILINE)
    if match is None:
        raise RuntimeError("ep_dispatcher setup: no version in pyproject.toml")
    return match.group(1)


def _find_nvcc() -> tuple[str | None, str | None]:
    """(cuda_home, nvcc) or (None, None)."""
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if cuda_home and os.path.isfile(os.path.join(cuda_home, "bin", "nvcc")):
        return cuda_home, os.path.join(cuda_home, "bin", "nvcc")
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        return None, None
    return os.path.dirname(os.path.dirname(os.path.realpath(nvcc))), nvcc


def _skip_reason() -> str | None:
    """Why the CUDA extension cannot or should not be built, or None to build it."""
    if os.environ.get("EP_DISPATCHER_NO_CUDA") == "1":
        return "EP_DISPATCHER_NO_CUDA=1"
    cuda_home, _ = _find_nvcc()
    if cuda_home is None:
        return "nvcc not found (set CUDA_HOME or put nvcc on PATH)"
    try:
        import torch
    except ImportError as exc:
        return f"torch is not importable ({exc}); install torch first and use --no-build-isolation"
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is a CPU-only build"
    return None


def _parse_cuda_archs(spec: str) -> tuple[list[str], list[str]]:
    """'90;90a;100+PTX' -> (gencode flags, arch names without suffix)."""
    flags, names = [], []
    for item in re.split(r"[;,\s]+", spec.strip()):
        if not item:
            continue
        embed_ptx = item.endswith("+PTX")
        arch = item[: -len("+PTX")] if embed_ptx else item
        arch = arch.replace(".", "")  # accept torch's "9.0a" spelling
        if not re.fullmatch(r"\d+[af]?", arch):
            raise ValueError(
                f"EP_DISPATCHER_CUDA_ARCHS: bad architecture {item!r} in {spec!r} (expected e.g. '90;90a;100')"
            )
        flags.append(f"-gencode=arch=compute_{arch},code=sm_{arch}")
        if embed_ptx:
            flags.append(f"-gencode=arch=compute_{arch},code=compute_{arch}")
        names.append(arch)
    if not flags:
        raise ValueError(f"EP_DISPATCHER_CUDA_ARCHS={spec!r} names no architecture")
    return flags, names


def _host_library(lib_dir: str) -> list[str] | None:
    """Link arguments for libnvshmem_host in lib_dir, or None."""
    if os.path.isfile(os.path.join(lib_dir, "libnvshmem_host.so")):
        return [f"-L{lib_dir}", "-lnvshmem_host"]
    # The pip wheel ships only the versioned file (no unversioned symlink), so name it exactly.
    versioned = sorted(glob.glob(os.path.join(lib_dir, "libnvshmem_host.so.*")))
    if versioned:
        return [f"-L{lib_dir}", f"-l:{os.path.basename(versioned[0])}"]
    return None


def _find_nvshmem() -> tuple[str, str, list[str]] | None:
    """(include_dir, lib_dir, link args) of NVSHMEM, or None."""
    if os.environ.get("EP_DISPATCHER_NO_NVSHMEM") == "1":
        _log("NVSHMEM disabled (EP_DISPATCHER_NO_NVSHMEM=1)")
        return None
    nvshmem_dir = os.environ.get("NVSHMEM_DIR")
    if nvshmem_dir:
        include_dir, lib_dir = os.path.join(nvshmem_dir, "include"), os.path.join(nvshmem_dir, "lib")
        link = _host_library(lib_dir)
        # An explicit NVSHMEM_DIR that does not hold NVSHMEM is a mistake worth stopping for.
        if not os.path.isfile(os.path.join(include_dir, "nvshmem.h")) or link is None:
            raise RuntimeError(f"NVSHMEM_DIR={nvshmem_dir} has no include/nvshmem.h or lib/libnvshmem_host.so*")
        return include_dir, lib_dir, link
    try:
        spec = importlib.util.find_spec("nvidia.nvshmem")
    except (ImportError, ValueError):
        spec = None
    # nvidia.nvshmem is a namespace package (no __init__.py) in both the cu12 and the cu13 wheels.
    for location in list(spec.submodule_search_locations or []) if spec else []:
        include_dir, lib_dir = os.path.join(location, "include"), os.path.join(location, "lib")
        link = _host_library(lib_dir)
        if os.path.isfile(os.path.join(include_dir, "nvshmem.h")) and link is not None:
            # Also resolve the wheel relative to a non-editable install (site-packages/ep_dispatcher/_C*.so), so a
            # built wheel keeps working in another environment that has the NVSHMEM wheel. The link step is spawned
            # without a shell, so $ORIGIN arrives literally.
            return include_dir, lib_dir, link + ["-Wl,-rpath,$ORIGIN/../nvidia/nvshmem/lib"]
    _log("NVSHMEM not found (install nvidia-nvshmem-cu13 or set NVSHMEM_DIR); building without it")
    return None


def _shared_libstdcxx() -> list[str]:
    """The libstdc++.so.6 this (torch-importing) process runs with, as a link input ahead of the driver's own -lstdc++.

    Some toolchains link libstdc++ statically (seen: a g++ wrapper whose -B directory holds only libstdc++.a). _C would
    then carry a second libstdc++ whose locale/iostream state torch never initialised, and it crashes the first time
    it formats an integer (e.g. in an error message). Naming the shared library first satisfies every libstdc++ symbol
    from it, so the static archive is never pulled in; on ordinary toolchains it changes nothing.
    """
    try:
        with open("/proc/self/maps", encoding="utf-8") as f:
            maps = f.read()
    except OSError:
        return []
    paths = sorted(set(re.findall(r"(/\S*/libstdc\+\+\.so\.6[.\d]*)$", maps, re.MULTILINE)))
    return paths[:1]


def _cuda_extension_kwargs(version: str) -> dict:
    cuda_home, _ = _find_nvcc()
    # torch.utils.cpp_extension reads CUDA_HOME when it is imported; without it torch may guess a wrong root.
    os.environ.setdefault("CUDA_HOME", cuda_home)
    os.environ.setdefault("MAX_JOBS", str(os.cpu_count() or 1))
    from torch.utils.cpp_extension import BuildExtension, CUDAExtension

    arch_flags, arch_names = _parse_cuda_archs(os.environ.get("EP_DISPATCHER_CUDA_ARCHS", DEFAULT_CUDA_ARCHS))
    # Bare tokens, stringified in C++ (quotes would not survive the shell/ninja round trip; ';' would end a command).
    defines = [f"-DEP_DISPATCHER_VERSION={version}", f"-DEP_DISPATCHER_CUDA_ARCHS={'_'.join(arch_names)}"]
    include_dirs = [os.path.join(ROOT, "csrc")]
    library_dirs: list[str] = []
    extra_link_args: list[str] = _shared_libstdcxx()
    if extra_link_args:
        _log(f"linking the shared libstdc++ torch runs with: {extra_link_args[0]}")

    nvshmem = _find_nvshmem()
    if nvshmem is not None:
        include_dir, lib_dir, link = nvshmem
        _log(f"NVSHMEM found: {include_dir}, {lib_dir}")
        defines.append("-DEP_DISPATCHER_WITH_NVSHMEM")
        include_dirs.append(include_dir)
        # NVSHMEM's headers include <cuda/std/...>, which CUDA 13 keeps under include/cccl.
        cccl = os.path.join(cuda_home, "include", "cccl")
        if os.path.isdir(cccl):
            include_dirs.append(cccl)
        library_dirs.append(lib_dir)
        # rpath: NVSHMEM's lib dir is not on the loader's search path.
        extra_link_args += link + [f"-Wl,-rpath,{lib_dir}"]
        # The low-latency kernels call NVSHMEM's device API, which lives in a static device library: compile
        # relocatable device code and device-link it (torch's BuildExtension runs `nvcc -dlink` on nvcc_dlink).
        nvcc_extra = ["-rdc=true"]
        nvcc_dlink = ["-dlink", f"-L{lib_dir}", "-lnvshmem_device"]
        extra_link_args += [os.path.join(lib_dir, "libnvshmem_device.a")]
    else:
        nvcc_extra, nvcc_dlink = [], []

    # No -std of our own: torch adds the standard its headers expect to both compilers when none is given (seen:
    # -std=c++17 with torch 2.11, -std=c++20 with torch 2.14, whose headers refuse C++17). The code here is C++17
    # clean; EP_DISPATCHER_CXX_STD (e.g. "c++17") forces a standard.
    cxx_std = os.environ.get("EP_DISPATCHER_CXX_STD")
    std_flags = [f"-std={cxx_std}"] if cxx_std else []
    cxx_flags = ["-O3"] + std_flags + defines
    nvcc_flags = ["-O3"] + std_flags + ["--expt-relaxed-constexpr", "-lineinfo"] + arch_flags + defines + nvcc_extra
    extra_compile_args = {"cxx": cxx_flags, "nvcc": nvcc_flags}
    if nvcc_dlink:
        extra_compile_args["nvcc_dlink"] = nvcc_dlink + arch_flags
    sources = [
        "csrc/ep_dispatcher_ext.cpp",
        "csrc/kernels/layout.cu",
        "csrc/kernels/logfmt.cu",
        "csrc/kernels/intranode.cu",
        "csrc/intranode_bindings.cpp",
        "csrc/kernels/low_latency.cu",
        "csrc/low_latency_bindings.cpp",
        "csrc/kernels/internode.cu",
        "csrc/internode_bindings.cpp",
        "csrc/runtime/driver_api.cpp",
        "csrc/runtime/ipc_buffer.cpp",
        "csrc/runtime/recv_pool.cpp",
        "csrc/runtime/timeout_record.cpp",
        # Always compiled: without EP_DISPATCHER_WITH_NVSHMEM it holds stubs that raise a clear error.
        "csrc/runtime/nvshmem_runtime.cpp",
    ]
    extension = CUDAExtension(
        name="ep_dispatcher._C",
        sources=sources,
        include_dirs=include_dirs,
        library_dirs=library_dirs,
        extra_compile_args=extra_compile_args,
        extra_link_args=extra_link_args,
    )
    std_text = f"-std={cxx_std}" if cxx_std else "torch's default -std"
    _log(f"building ep_dispatcher._C for sm {';'.join(arch_names)}, {std_text}, MAX_JOBS={os.environ['MAX_JOBS']}")
    return {"ext_modules": [extension], "cmdclass": {"build_ext": BuildExtension}}


def main() -> None:
    version = _read_version()
    skip_reason = _skip_reason()
    if skip_reason is None:
        build_kwargs = _cuda_extension_kwargs(version)
    else:
        _log(f"skipping the CUDA extension ep_dispatcher._C: {skip_reason}")
        build_kwargs = {}
        # An editable install imports from the source tree, where an earlier build's extension would still win.
        for stale in glob.glob(os.path.join(ROOT, "ep_dispatcher", "_C.*.so")):
            _log(f"warning: {stale} from an earlier build is still there and will be imported; delete it if unwanted")

    packages = find_packages(include=["ep_dispatcher", "ep_dispatcher.*"]) + ["ep_dispatcher.configs"]
    setup(
        packages=packages,
        package_dir={"ep_dispatcher.configs": "configs"},
        package_data={"ep_dispatcher.configs": ["*.json"]},
        **build_kwargs,
    )


if __name__ == "__main__":
    sys.exit(main())
