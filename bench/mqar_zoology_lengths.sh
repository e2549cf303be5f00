#!/usr/bin/env bash
# Issue 16's recall comparison at Zoology's test lengths: the five configs/mqar_*.yaml retrained with Zoology's
# longest train entry added (256 codes, 64 pairs) and evaluated up to Zoology's longest test entries (512 codes
# with 128 pairs, 1024 with 256): pair counts and lengths beyond training, as in Zoology's test mix. A vocabulary
# of 2048 codes (it must exceed the longest sequence; 1024 keys, 1024 values, three letters each), a tokenizer
# large enough for every code to be one token, positions for 1024 codes. docs/retrieval.md, "Zoology's lengths".
#
#   bench/mqar_zoology_lengths.sh [OUTPUT_DIR] [MODELS...]      # default runs/zoology-lengths, all five
#   SFT_EPOCHS=3 bench/mqar_zoology_lengths.sh runs/zoology-lengths-3ep sse_h   # a longer schedule (default 1)
#   python bench/mqar_compare.py --runs runs/zoology-lengths --values 1024 --tag DATE-zoology-lengths
set -euo pipefail
out=${1:-runs/zoology-lengths}; shift || true
models=${*:-sse_h sse gla transformer sse_dense}
mix='[{context_length: 24, num_pairs: 4}, {context_length: 48, num_pairs: 8}, {context_length: 96, num_pairs: 16},
      {context_length: 192, num_pairs: 32}, {context_length: 256, num_pairs: 64}'
train="{format: zoology, vocab_size: 2048, mix: $mix]}"
test="{format: zoology, vocab_size: 2048, mix: $mix, {context_length: 512, num_pairs: 128},
       {context_length: 1024, num_pairs: 256}]}"
cd "$(dirname "$0")/.."
for model in $models; do
  .venv/bin/sse-rl run "configs/mqar_$model.yaml" --set "output_dir=$out" --set "sft.epochs=${SFT_EPOCHS:-1}" \
    --set model.tokenizer.vocab_size=4096 --set model.config.max_position_embeddings=1536 \
    --set "data.sft.generator.options=$train" \
    --set "data.eval=[{source: generator, name: mqar-zoology, split: test,
                       generator: {task: mqar, num_examples: 700, seed: 0, options: $test}}]"
done
