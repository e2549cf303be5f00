#!/usr/bin/env bash
# Builds the offline wheelhouse for an air-gapped GPU node whose image has Python 3.12, torch 2.11 (CUDA 13),
# triton and transformers, and no vLLM, TRL, Ray or datasets (docs/gpu-install.md):
#   - vLLM 0.25.0 (the release pinned to torch 2.11, inside TRL 1.16's vLLM range), stripped of the libraries a
#     dense or hybrid decoder on Hopper never loads (FlashAttention-2, MoE, DeepGEMM, FlashMLA, Blackwell), and the
#     wheels vLLM imports at engine start that the image lacks;
#   - TRL, datasets, math-verify, fla-core, Ray and what they need there;
#   - this project as a wheel (its entry points: `sse-rl` and the vLLM plugin), installed without dependencies.
# Everything goes into parts of at most PART_MIB (58) MiB, the largest copy that reaches the nodes, with install.sh
# in part-1.
#
#   scripts/build-wheelhouse.sh OUT             # on a machine with network (pip download)
#   scripts/build-wheelhouse.sh --dry-run OUT   # print the plan only: no network, nothing written
#   scripts/build-wheelhouse.sh --no-ray OUT    # without Ray (80 MB): enough for the GPU tests and the benches
#   (copy OUT/part-* and this checkout to the node, then there)
#   scripts/gpu-offline-install.sh OUT/part-*
set -euo pipefail

PART_MIB=58
PYTHON_VERSION=3.12
PLATFORMS=(manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_26_x86_64 manylinux_2_17_x86_64
           manylinux2014_x86_64 manylinux_2_5_x86_64 manylinux1_x86_64)
VLLM=vllm==0.25.0
# vLLM 0.25's import-time needs that the image lacks (its other requirements are in the image or loaded lazily).
VLLM_DEPS=(fastapi==0.136.3 starlette==1.10.0 openai==2.54.0 openai-harmony==0.0.8 pydantic==2.14.3
           pydantic-core==2.50.4 annotated-types==0.8.0 typing-inspection==0.4.5 pyzmq==27.3.0 msgspec==0.22.0
           cbor2==6.3.0 pybase64==1.5.1 partial-json-parser==0.2.1.1.post7 cachetools==8.0.1 distro==1.9.0
           jiter==0.19.0 sniffio==1.3.1)
# The versions of pyproject.toml's `train` and `gpu` extras (tests/test_packaging.py keeps them equal).
TRAIN_DEPS=(trl==1.16.0 datasets==5.2.0 math-verify==0.9.0 fla-core==0.6.0 dill==0.4.1 multiprocess==0.70.19
            latex2sympy2-extended==1.11.0 antlr4-python3-runtime==4.13.2)
RAY_DEPS=(ray==2.60.0 jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0
          rpds-py==2026.9.1)
# Members of the vLLM wheel left out.
DROP=(vllm/vllm_flash_attn/_vllm_fa2_C vllm/_moe_C vllm/vllm-rs vllm/third_party/deep_gemm
      vllm/third_party/fmha_sm100 vllm/_flashmla vllm/_qutlass_C vllm/_rust_tool_parser
      vllm/entrypoints/serve/instrumentator/static)

usage() { sed -n 2,16p "$0"; exit 2; }
dry_run=0
ray=1
while [ $# -gt 1 ]; do
  case $1 in
    --dry-run) dry_run=1 ;;
    --no-ray) ray=0 ;;
    *) usage ;;
  esac
  shift
done
[ $# -eq 1 ] || usage
out=$1
repo=$(cd "$(dirname "$0")/.." && pwd)
platform_args=(--python-version "$PYTHON_VERSION" --implementation cp --only-binary=:all: --no-deps)
for p in "${PLATFORMS[@]}"; do platform_args+=(--platform "$p"); done
specs=("$VLLM" "${VLLM_DEPS[@]}" "${TRAIN_DEPS[@]}")
[ $ray = 1 ] && specs+=("${RAY_DEPS[@]}")

if [ $dry_run = 1 ]; then
  echo "target: CPython $PYTHON_VERSION, ${PLATFORMS[*]}"
  echo "download: python3 -m pip download -q ${platform_args[*]} -d $out/download ${specs[*]}"
  echo "project: python3 -m pip wheel -q --no-deps -w $out/download $repo"
  echo "strip from $VLLM: ${DROP[*]}"
  echo "parts: $out/part-1 ... of at most $PART_MIB MiB each; files over $PART_MIB MiB cut into .part-NN pieces"
  echo "install script: $out/part-1/install.sh (on the node: scripts/gpu-offline-install.sh $out/part-*)"
  exit 0
fi

dl=$out/download
mkdir -p "$dl"
python3 -m pip download -q "${platform_args[@]}" -d "$dl" "${specs[@]}"
python3 -m pip wheel -q --no-deps -w "$dl" "$repo"
DROP="${DROP[*]}" PART_MIB=$PART_MIB python3 - "$out" <<'PY'
"""Strip the vLLM wheel into two zips (its core ops library alone, and the rest), cut files over the part size
into byte ranges (install.sh joins them), and fill the parts greedily, largest files first."""
import os, pathlib, shutil, sys, zipfile

out = pathlib.Path(sys.argv[1])
dl, drop, limit = out / "download", tuple(os.environ["DROP"].split()), int(os.environ["PART_MIB"]) * 2**20
wheel = next(dl.glob("vllm-0.25.0-*.whl"))
big = "vllm/_C_stable_libtorch"
with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(dl / "vllm-stripped-1.zip", "w") as a, \
        zipfile.ZipFile(dl / "vllm-stripped-2.zip", "w") as b:
    for info in src.infolist():
        if not info.filename.startswith(drop):
            (a if info.filename.startswith(big) else b).writestr(info, src.read(info.filename))
wheel.unlink()
pieces = []
for f in sorted(dl.iterdir(), key=lambda p: -p.stat().st_size):
    if f.stat().st_size <= limit:
        pieces.append(f)
        continue
    data = f.read_bytes()
    for i in range(0, len(data), limit):
        piece = dl / f"{f.name}.part-{i // limit:02d}"
        piece.write_bytes(data[i:i + limit])
        pieces.append(piece)
    f.unlink()
parts = []
for p in pieces:
    size = p.stat().st_size
    slot = next((q for q in parts if q[0] + size <= limit), None)
    if slot is None:
        slot = [0, []]
        parts.append(slot)
    slot[0] += size
    slot[1].append(p)
for i, (size, files) in enumerate(parts, 1):
    d = out / f"part-{i}"
    d.mkdir(exist_ok=True)
    for f in files:
        shutil.move(str(f), d / f.name)
    print(f"{d}: {size / 2**20:.1f} MiB, {len(files)} files")
shutil.rmtree(dl)
PY

cat > "$out/part-1/install.sh" <<'SH'
#!/usr/bin/env bash
# Reassembles the parts and installs everything into /tmp/site. Usage: bash install.sh PART_DIR...
set -euo pipefail
mkdir -p /tmp/site /tmp/wheelhouse
for d in "$@"; do cp -r "$d"/. /tmp/wheelhouse/; done
cd /tmp/wheelhouse
for base in $(ls *.part-* 2>/dev/null | sed 's/\.part-[0-9]*$//' | sort -u); do
  cat "$base".part-* > "$base" && rm "$base".part-*
done
# the node has no unzip
python3 -c 'import glob, zipfile; [zipfile.ZipFile(f).extractall("/tmp/site") for f in sorted(glob.glob("vllm-stripped-*.zip"))]'
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site ./*.whl
# vLLM 0.25 evaluates annotations naming llguidance and xgrammar (structured output) at import; neither has a wheel
# for this platform and neither is used without structured output: a name-only module stands in for each.
for m in llguidance xgrammar; do
  python3 -c "import $m" 2>/dev/null && continue
  mkdir -p /tmp/site/$m
  printf 'def __getattr__(name):\n    if name.startswith("__"):\n        raise AttributeError(name)\n    return type(name, (), {})\n' > /tmp/site/$m/__init__.py
done
echo "installed into /tmp/site: $(ls /tmp/site | wc -l) entries"
SH
echo "wrote $(ls -d "$out"/part-* | wc -l) parts into $out; install.sh is in $out/part-1"
