#!/usr/bin/env bash
# Installs the GPU stack on an air-gapped node whose image already has Python 3.12, torch 2.11 (CUDA 13), triton and
# transformers, from the wheelhouse scripts/build-wheelhouse.sh built on a machine with network (docs/gpu-install.md):
#
#   (on a machine with network)  scripts/build-wheelhouse.sh WHEELHOUSE
#   (copy WHEELHOUSE/part-* and this checkout to the node, then on the node, from this checkout)
#   scripts/gpu-offline-install.sh WHEELHOUSE/part-*        # installs into /tmp/site
#   source /tmp/site/sse-rl.env                              # PYTHONPATH and vLLM settings for this shell
#
# The project's wheel (installed without dependencies: its pyproject pins the CPU machines' torch 2.13) gives vLLM
# the plugin's entry point and the `sse-rl` script; the checkout goes first on PYTHONPATH, so its code is what runs.
set -euo pipefail
[ $# -ge 1 ] || { sed -n 2,11p "$0"; exit 2; }
site=/tmp/site  # where the wheelhouse's install.sh puts everything
repo=$(cd "$(dirname "$0")/.." && pwd)
first=$1
[ -f "$first/install.sh" ] || { echo "$first/install.sh not found: pass every part, part-1 first" >&2; exit 2; }
bash "$first/install.sh" "$@" >/dev/null
cat > "$site/sse-rl.env" <<ENV
export PYTHONPATH=$repo:$site\${PYTHONPATH:+:\$PYTHONPATH}
export PATH=$site/bin:\$PATH
export HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 VLLM_USE_FLASHINFER_SAMPLER=0
ENV
echo "installed into $site; run: source $site/sse-rl.env"
