#!/usr/bin/env bash
# Builds ep_dispatcher._C on the workstation for the GPU machine, so that a device call need not spend its minutes
# compiling: the extension is built against the GPU machine's Python, torch and NVSHMEM (a side venv with those
# versions), stripped of debug info (about 8 MB), and stamped with the versions in ep_dispatcher/_C.prebuilt.txt.
# run_device.sh's build phase uses it when it imports there and the stamp matches that machine's torch and NVSHMEM;
# else it builds.
# Carry both files: run(..., carry=["ep_dispatcher/_C.cpython-312-x86_64-linux-gnu.so", "ep_dispatcher/_C.prebuilt.txt"]).
# Usage: bash tests/gpu/prebuild_extension.sh   (DEVICE_PYTHON, DEVICE_TORCH, DEVICE_NVSHMEM, PREBUILD_VENV override)
set -euo pipefail
cd "$(dirname "$0")/../.."
# The GPU machine's versions (../.library/device/KINDS.md: Python 3.12, torch 2.11.0+cu130; its NVSHMEM wheel).
DEVICE_PYTHON=${DEVICE_PYTHON:-python3.12}
DEVICE_TORCH=${DEVICE_TORCH:-2.11.0}
DEVICE_NVSHMEM=${DEVICE_NVSHMEM:-3.4.5}
PREBUILD_VENV=${PREBUILD_VENV:-$HOME/.cache/ep_dispatcher/device-venv}
# A pyenv whose global version is not 3.12 answers "command not found" for python3.12: take its 3.12 install.
if ! "$DEVICE_PYTHON" -V > /dev/null 2>&1; then
    DEVICE_PYTHON=$(ls -d "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12*/bin/python3.12 2> /dev/null | head -1)
    [ -n "$DEVICE_PYTHON" ] || { echo "prebuild_extension: no Python 3.12 found; set DEVICE_PYTHON to one" >&2; exit 1; }
fi
if [ ! -x "$PREBUILD_VENV/bin/python" ]; then
    "$DEVICE_PYTHON" -m venv "$PREBUILD_VENV"
    "$PREBUILD_VENV/bin/pip" install -q "torch==$DEVICE_TORCH" "nvidia-nvshmem-cu13==$DEVICE_NVSHMEM" pybind11 ninja numpy \
        packaging setuptools
fi
py=$PREBUILD_VENV/bin/python
suffix=$("$py" -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')
CUDA_HOME=${CUDA_HOME:-/usr/local/cuda} MAX_JOBS=${MAX_JOBS:-2} "$py" setup.py build_ext --inplace > /tmp/prebuild_extension.log 2>&1 ||
    { tail -30 /tmp/prebuild_extension.log; exit 1; }
strip --strip-debug "ep_dispatcher/_C$suffix"
"$py" - > ep_dispatcher/_C.prebuilt.txt <<'EOF'
import importlib.metadata as m
import torch
print(f"torch={torch.__version__} nvshmem={m.version('nvidia-nvshmem-cu13')}")
EOF
echo "built ep_dispatcher/_C$suffix ($(du -h "ep_dispatcher/_C$suffix" | cut -f1)): $(cat ep_dispatcher/_C.prebuilt.txt)"
