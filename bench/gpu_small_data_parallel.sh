#!/usr/bin/env bash
# configs/gpu_small.yaml's init -> sft -> grpo data-parallel on two GPUs of one node (Ray Train over NCCL, each rank
# its own colocated vLLM engine) and then on one GPU of the same node, with the same global batches (SFT 32
# examples, GRPO 32 prompts x 8), so step times compare directly (issue 15, docs/pipeline.md "On a GPU").
# The two-GPU run goes first (it pays the fresh node's compilation) and kills one Ray Train worker inside GRPO
# step 3 (save_steps 2): the stage must resume from checkpoint-2 and end at step 8.
#
#   bench/gpu_small_data_parallel.sh OUT_DIR RUNS [WHEELHOUSE_PART...]   # on the GPU node; parts: install first
#
# RUNS: "2gpu 1gpu" (and "2gpu-sft", below), or one of them per call. On a fresh node the two-GPU run needs about
# 7 minutes (Ray start ~30 s, SFT's first compilation ~30 s, each GRPO engine start 100-140 s, the restart after the
# kill another), so give each run a call of its own on the same machine (the next call within its 30 s of warmth:
# the 1-GPU run then finds the compiled kernels). TWO_GPU_LIMIT / ONE_GPU_LIMIT: seconds per run (default 540 / 300).
#
# OUT_DIR gets each run's console, metrics, manifest and report (tarred) and the GRPO phase tables.
set -uo pipefail
out=$1 runs=$2; shift 2
mkdir -p "$out"
repo=$(cd "$(dirname "$0")/.." && pwd)
if [ $# -gt 0 ]; then "$repo/scripts/gpu-offline-install.sh" "$@" || exit 1; fi
source /tmp/site/sse-rl.env
# NVLink multicast stays off (shared hosts: KINDS.md); every process of the run inherits these.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 VLLM_USE_FLASHINFER_SAMPLER=0
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader

common=(--set "stages=[init, sft, grpo]" --set data.sft.generator.num_examples=3200 --set grpo.steps=8
        --set grpo.save_steps=2 --set sft.save_steps=100 --set output_dir=/tmp/runs)
two=(--set name=gpu-small-2gpu --set resources.sft.num_workers=2 --set sft.per_device_batch_size=16
     --set resources.grpo.num_workers=2 --set grpo.per_device_batch_size=32)

run() {  # NAME SECONDS SKIP ARGS...: one pipeline run under a time limit, its files into $out; SKIP: GRPO steps
  local name=$1 limit=$2 skip=$3; shift 3  # left out of the medians (engine start, first step after a resume)
  local started=$SECONDS
  timeout -k 15 "$limit" env SSE_RL_FAULTS="${SSE_RL_FAULTS:-}" \
    python3 -m pipeline run configs/gpu_small.yaml "${common[@]}" "$@" > "$out/console-$name.txt" 2>&1
  echo "== $name: exit $? after $((SECONDS - started)) s"; tail -25 "$out/console-$name.txt"
  local dir=/tmp/runs/gpu-small-$name
  [ -n "$skip" ] && python3 "$repo/bench/grpo_phases.py" "$dir" --skip $skip \
    && cp "$dir/grpo_phases.md" "$out/grpo_phases-$name.md"
  tar czf "$out/run-$name.tgz" -C /tmp/runs --exclude "checkpoint-*" --exclude "model" --exclude "final" \
    --exclude "*.safetensors" "gpu-small-$name"
  # A driver stopped by the time limit can leave Ray workers (and their engines) on the GPUs.
  pkill -9 -f "ray::|raylet|gcs_server|ray/_private" ; sleep 3
}

cd "$repo"
for which in $runs; do
  case $which in
    2gpu) SSE_RL_FAULTS=grpo.step@3:kill run 2gpu "${TWO_GPU_LIMIT:-540}" "1 3" "${two[@]}" ;;
    1gpu) run 1gpu "${ONE_GPU_LIMIT:-300}" 1 --set name=gpu-small-1gpu ;;
    # SFT alone on two GPUs with DDP's unused-parameter search off (transformers turns it on for a model without
    # gradient checkpointing): is the search what makes two GPUs slower than one at this size?
    2gpu-sft) run 2gpu-sft "${TWO_GPU_LIMIT:-540}" "" "${two[@]}" --set name=gpu-small-2gpu-sft \
                --set "stages=[init, sft]" --set sft.ddp_find_unused_parameters=false ;;
    *) echo "unknown run $which (2gpu, 1gpu, 2gpu-sft)"; exit 2 ;;
  esac
done
