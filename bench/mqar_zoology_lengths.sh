#!/usr/bin/env bash
# Issue 16's recall comparison at Zoology's test lengths: the six configs/mqar_*.yaml retrained with Zoology's
# longest train entry added (256 codes, 64 pairs) and evaluated up to Zoology's longest test entries (512 codes
# with 128 pairs, 1024 with 256): pair counts and lengths beyond training, as in Zoology's test mix. A vocabulary
# of 2048 codes (it must exceed the longest sequence; 1024 keys, 1024 values, three letters each), a tokenizer
# large enough for every code to be one token, positions for 1024 codes: the overrides, one per line, are in
# bench/mqar_zoology_lengths.sets (bench/mqar_sweep.py's GPU rig reads the same file: `sets=`).
# docs/retrieval.md, "Zoology's lengths".
#
#   bench/mqar_zoology_lengths.sh [OUTPUT_DIR] [MODELS...]      # default runs/zoology-lengths, all six
#   SFT_EPOCHS=3 bench/mqar_zoology_lengths.sh runs/zoology-lengths-3ep sse_h   # a longer schedule (default 1)
#   python bench/mqar_compare.py --runs runs/zoology-lengths --values 1024 --tag DATE-zoology-lengths
set -euo pipefail
out=${1:-runs/zoology-lengths}; shift || true
models=${*:-sse_h sse gla gla_pure transformer sse_dense}
cd "$(dirname "$0")/.."
sets=()
while IFS= read -r line; do if [[ -n $line ]]; then sets+=(--set "$line"); fi; done < bench/mqar_zoology_lengths.sets
for model in $models; do
  .venv/bin/sse-rl run "configs/mqar_$model.yaml" --set "output_dir=$out" --set "sft.epochs=${SFT_EPOCHS:-1}" \
    "${sets[@]}"
done
