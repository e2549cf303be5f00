"""The engine's host work per decode step, SSE-H against Qwen3, on whatever vLLM is installed (the CPU build too).

    python bench/vllm_host_profile.py SSE-H|Qwen3 [--requests 128] [--steps 65] [--timers] [--no-prefix-caching]

A 12-layer model of width 64 (SSE-H: one attention layer in six, so two KV-cache groups) decodes `--steps` tokens
for `--requests` requests in an in-process engine under cProfile; prints the scheduler's and the model runner's
cumulative time per step (the outermost call of each name). The model is tiny so that host work, not the model,
is what differs (docs/vllm-backend.md, "Fewer kernels per SSE layer, and a host-bound step"). cProfile inflates
small Python calls; `--timers` instead wraps the same calls of this engine in wall-clock timers (no profiler) and
also prints the whole step. `--no-prefix-caching` runs the engine as vLLM 0.25 runs a hybrid on a GPU (the CPU
build's default turns prefix caching on for hybrids too, with its Mamba "align" bookkeeping).
"""
import argparse
import cProfile
import io
import os
import pstats
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
FUNCTIONS = ["schedule", "allocate_slots", "update_from_output", "execute_model"]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("model", choices=["SSE-H", "Qwen3"])
    p.add_argument("--requests", type=int, default=128)
    p.add_argument("--steps", type=int, default=65)
    p.add_argument("--timers", action="store_true", help="wall-clock timers around the calls instead of cProfile")
    p.add_argument("--no-prefix-caching", action="store_true", help="enable_prefix_caching=False")
    args = p.parse_args()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from transformers import AutoModelForCausalLM, Qwen3Config
    from vllm import LLM, SamplingParams

    from sse_model import SSEConfig
    from sse_model.configuration_sse import default_layer_types

    dims = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=12, num_attention_heads=2,
                num_key_value_heads=2, head_dim=32, vocab_size=512, max_position_embeddings=4096,
                tie_word_embeddings=True)
    config = (SSEConfig(**dims, sse_num_partitions=4, sse_top_k=1, sse_shared_partition=True, sse_lora_rank=8,
                        layer_types=default_layer_types(12)) if args.model == "SSE-H" else Qwen3Config(**dims))
    path = Path(tempfile.mkdtemp()) / args.model
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    llm = LLM(model=str(path), skip_tokenizer_init=True, dtype="float32", max_model_len=1024, seed=0,
              max_num_seqs=args.requests, gpu_memory_utilization=0.1,
              **(dict(enable_prefix_caching=False) if args.no_prefix_caching else {}))
    prompts = [{"prompt_token_ids": torch.randint(0, 512, (32,)).tolist()} for _ in range(args.requests)]

    def run(steps):
        params = SamplingParams(temperature=1.0, max_tokens=steps, min_tokens=steps, ignore_eos=True,
                                detokenize=False)
        llm.generate(prompts, params, use_tqdm=False)

    run(4)  # warm-up
    if args.timers:
        return print_timers(llm, run, args)
    profiler = cProfile.Profile()
    profiler.runcall(run, args.steps)
    stats = pstats.Stats(profiler, stream=io.StringIO()).stats
    print(f"{args.model}, {args.requests} requests, {args.steps} decode steps, under cProfile:")
    for name in FUNCTIONS:
        total = max(v[3] for (file, _, func), v in stats.items() if func == name and "vllm" in file)
        print(f"  {name:20s} {total / args.steps * 1e3:6.2f} ms per step")


def print_timers(llm, run, args):
    """The calls named in FUNCTIONS, on this engine's objects, each in a wall-clock accumulator, over one run."""
    core = llm.llm_engine.engine_core.engine_core  # the in-process engine core
    owner = {"schedule": core.scheduler, "update_from_output": core.scheduler,
             "allocate_slots": core.scheduler.kv_cache_manager, "execute_model": core.model_executor}
    totals = dict.fromkeys(FUNCTIONS, 0.0)

    def timed(name, call):
        def wrapper(*a, **kw):
            t = time.perf_counter()
            try:
                return call(*a, **kw)
            finally:
                totals[name] += time.perf_counter() - t
        return wrapper
    for name in FUNCTIONS:
        setattr(owner[name], name, timed(name, getattr(owner[name], name)))
    t = time.perf_counter()
    run(args.steps)
    step = (time.perf_counter() - t) / args.steps
    print(f"{args.model}, {args.requests} requests, {args.steps} decode steps, wall-clock timers:")
    for name, total in totals.items():
        print(f"  {name:20s} {total / args.steps * 1e3:6.2f} ms per step")
    print(f"  {'whole step':20s} {step * 1e3:6.2f} ms")


if __name__ == "__main__":
    main()
