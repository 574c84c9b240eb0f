#!/usr/bin/env bash
# The one-shot GPU check, run from the repository root on a lent GPU machine (the device tool's
# `run`): nothing is installed (nothing can be fetched there; the image has torch,
# transformers, safetensors and httpx), the results go to $OUT/gpu_check.json. See check.py.
#   bash benchmarks/gpu/check.sh            # on the GPU machine
#   bash benchmarks/gpu/check.sh --cpu      # the dry run, here
set -euo pipefail
cd "$(dirname "$0")/../.."
out="${OUT:-benchmarks/results}"
py="$(command -v python3)"
[ -x .venv/bin/python ] && [ -z "${OUT:-}" ] && py=.venv/bin/python
PYTHONUNBUFFERED=1 PYTHONPATH=src timeout 570 "$py" benchmarks/gpu/check.py \
	--out "$out/gpu_check.json" --deadline-s 480 "$@"
