#!/usr/bin/env bash
# Pure-Python packages the GPU machine lacks and cannot download (it has no network): copied from a local
# environment into .device_carry/site (git-ignored), which run_device.sh puts on PYTHONPATH. Pass the path to
# `run(..., carry=[".device_carry"])`. Usage: [PYTHON=/venv/bin/python] bash tests/gpu/prepare_carry.sh [/path/to/site-packages]
set -euo pipefail
cd "$(dirname "$0")/../.."
# Found by path, not by import: importing megatron.core prints warnings and needs torch.
SITE=${1:-$(${PYTHON:-python3} -c 'import importlib.util, os; print(os.path.dirname(importlib.util.find_spec("megatron").submodule_search_locations[0]))')}
rm -rf .device_carry && mkdir -p .device_carry/site
cp -r "$SITE/megatron" .device_carry/site/
find .device_carry -name __pycache__ -type d -prune -exec rm -rf {} +
du -sh .device_carry
