#!/usr/bin/env bash
# Installs the GPU stack on an air-gapped node whose image already has torch 2.11 (CUDA 13), triton and
# transformers, from a wheelhouse built on a machine with network access (docs/gpu.md):
#
#   (on a machine with network)  ../shared/tools/gpu-wheelhouse WHEELHOUSE [--ray]
#   (copy WHEELHOUSE/part-* to the node, then on the node, from this checkout)
#   scripts/gpu-offline-install.sh WHEELHOUSE/part-*        # installs into /tmp/site
#   source /tmp/site/sse-rl.env                              # PYTHONPATH for this shell
#
# The project is not pip-installed there (its pyproject pins the CPU machines' torch 2.13): the checkout goes on
# PYTHONPATH, and a metadata-only distribution gives vLLM the plugin's entry point, exactly what
# `pip install -e .` would register.
set -euo pipefail
[ $# -ge 1 ] || { sed -n 2,11p "$0"; exit 2; }
site=/tmp/site  # where the wheelhouse's install.sh puts everything
repo=$(cd "$(dirname "$0")/.." && pwd)
first=$1
bash "$first/install.sh" "$@" >/dev/null
dist="$site/sse_rl-0.0.dist-info"
mkdir -p "$dist"
printf 'Metadata-Version: 2.1\nName: sse-rl\nVersion: 0.0\n' > "$dist/METADATA"
printf '[vllm.general_plugins]\nsse_model = sse_model.vllm.plugin:register\n' > "$dist/entry_points.txt"
cat > "$site/sse-rl.env" <<EOF
export PYTHONPATH=$site:$repo\${PYTHONPATH:+:\$PYTHONPATH}
export HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1
EOF
echo "installed into $site; run: source $site/sse-rl.env"
