"""Where one decode step of a rollout batch goes, in vLLM with its default compiled engine (CUDA graphs on).

    python bench/vllm_decode_profile.py --model SSE-H|Qwen3 [--shape small|1b] [--batch 256]
                                        [--state-dtype auto|bfloat16] [--out DIR] [--wall-only | --prefill]

The engine runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0) so torch.profiler sees its kernels. It prints
(1) the decode step's wall time, from two runs that differ only in their number of new tokens, and (2) the GPU
time per kernel and decode step, from the profiles of two runs that differ by 32 decode steps (so the prefill
drops out), sorted, with the share of each and the GPU's share of the wall time; the same tables go to DIR.
`--state-dtype bfloat16` stores SSE-H's states in bfloat16.

`--prefill` profiles the batch's prefill instead (a 1-token generation of `--batch` fresh 256-token prompts, prefix
caching off for every model so that Qwen3 computes every prompt as SSE-H does): its wall time and GPU time per
kernel. In the rollout benchmark SSE-H prefills all n copies of a prompt where Qwen3's prefix cache computes one
(bench/results/vllm_states_manager_gpu_20261128.md: 0.84-0.91 s against 0.13-0.15 s at 256 x 256 tokens); this
says whether SSE-H's prefill is also slower per token.
"""
import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))


def decode_kernel_alone(batch, H=8, N=4, c=128, dv=128, state_dtype=torch.float32) -> str:
    """kernels.sse_decode by itself on a state cache like vLLM's (bf16 inputs), CUDA-graph replay."""
    import kernels
    from sse_decode_launch import decode_case, replay_ms, state_bytes
    state, slots, x = decode_case(batch, H, N, c, dv, state_dtype)
    ms = replay_ms(lambda: kernels.sse_decode(state, slots, **x, top_k=1))
    return (f"sse_decode alone, batch {batch}, H {H}, N {N}, c = d_v = {c}, {state_dtype} states: "
            f"{ms * 1e3:.1f} us per layer, {state_bytes(state, batch) / ms / 1e6:.0f} GB/s of state traffic")


def kernel_times(llm_run, new_tokens) -> dict[str, tuple[int, float]]:
    """GPU time (ms) and calls per kernel over one generate call."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        llm_run(new_tokens)
    return {e.key: (e.count, e.device_time_total / 1e3) for e in prof.key_averages()
            if e.device_time_total > 0 and e.device_type.name == "CUDA"}


def kernel_table(times: dict[str, tuple[float, float]], total: float, rows: int = 25) -> list[str]:
    """Markdown rows of the largest kernels: calls, ms and share of `total` ms."""
    lines = ["| kernel | calls | ms | share |", "| --- | ---: | ---: | ---: |"]
    for key, (calls, ms) in sorted(times.items(), key=lambda kv: -kv[1][1])[:rows]:
        lines.append(f"| {key[:90]} | {calls:.1f} | {ms:.3f} | {ms / total:.1%} |")
    return lines


def profile_prefill(args, run, llm) -> None:
    """Wall time of the batch's prefill (a 1-token generation; the median of three) and its GPU time per kernel."""
    walls = sorted(run(1) for _ in range(3))
    kernels = kernel_times(run, 1)
    total = sum(ms for _, ms in kernels.values())
    from vllm_rollouts import PROMPT_TOKENS
    tokens = args.batch * PROMPT_TOKENS
    batched = llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens
    lines = [f"{args.model} ({args.shape}), prefill of {args.batch} prompts x {PROMPT_TOKENS} tokens (prefix caching "
             f"off, max_num_batched_tokens {batched}): {walls[1]:.3f} s of wall time (runs {walls[0]:.3f}-"
             f"{walls[2]:.3f} s, {tokens / walls[1]:,.0f} prompt tokens/s), {total / 1e3:.3f} s of GPU kernels in a "
             "profiled run"]
    lines += kernel_table(kernels, total)
    text = "\n".join(lines)
    print(text, flush=True)
    (args.out / f"prefill_profile_{args.shape}_{args.model}.md").write_text(text + "\n")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="SSE-H")
    p.add_argument("--shape", default="small")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--state-dtype", default="auto", help="vLLM's mamba_ssm_cache_dtype (SSE-H only)")
    p.add_argument("--out", type=Path, default=Path("/tmp"))
    p.add_argument("--wall-only", action="store_true", help="only the decode step's wall time (an A/B of two trees)")
    p.add_argument("--prefill", action="store_true", help="profile the batch's prefill instead of a decode step")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import tempfile
    from types import SimpleNamespace

    from transformers import AutoModelForCausalLM
    from vllm import LLM, SamplingParams

    from sse_model.vllm.engine import state_dtype as sse_state_dtype
    from vllm_rollouts import COMMON, PROMPT_TOKENS, configs  # configs() imports sse_model: registers sse_hybrid

    path = Path(tempfile.mkdtemp()) / args.model
    torch.manual_seed(0)
    config = configs(args.shape)[args.model]
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(path)
    sse = args.model.startswith("SSE")
    engine = dict(mamba_ssm_cache_dtype=args.state_dtype) if sse else {}
    if args.prefill:  # every run recomputes its prompts, Qwen3's too
        engine["enable_prefix_caching"] = False
    llm = LLM(model=str(path), skip_tokenizer_init=True, dtype="bfloat16", seed=0, max_model_len=2048, **engine)
    prompts = [{"prompt_token_ids": torch.randint(0, COMMON["vocab_size"], (PROMPT_TOKENS,)).tolist()}
               for _ in range(args.batch)]

    def run(new_tokens):
        params = SamplingParams(temperature=1.0, max_tokens=new_tokens, min_tokens=new_tokens, ignore_eos=True,
                                detokenize=False)
        t = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - t

    run(16)
    if args.prefill:
        return profile_prefill(args, run, llm)
    short, long = run(32), run(288)
    step_ms = (long - short) / 256 * 1e3
    name = args.model + ("" if args.state_dtype == "auto" else f" ({args.state_dtype} states)")
    cache = SimpleNamespace(mamba_ssm_cache_dtype=args.state_dtype, mamba_cache_dtype="auto")
    state_dtype = sse_state_dtype(cache, torch.bfloat16) if sse else None  # what the bf16 engine stores
    lines = [decode_kernel_alone(args.batch, H=config.sse_num_heads, state_dtype=state_dtype)] \
        if sse and not args.wall_only else []
    lines += [f"{name} ({args.shape}), batch {args.batch}: decode step {step_ms:.2f} ms of wall time "
              f"({args.batch / step_ms * 1e3:,.0f} tokens/s in steady decode); 32 tokens took {short:.2f} s"]
    if args.wall_only:
        print(lines[-1], flush=True)
        return
    # Kernels of 32 decode steps alone: a 65-token run minus a 33-token run (same prefill, same prompts).
    base, more = kernel_times(run, 33), kernel_times(run, 65)
    per_step = {k: ((n - base.get(k, (0, 0))[0]) / 32, (ms - base.get(k, (0, 0.0))[1]) / 32)
                for k, (n, ms) in more.items()}
    per_step = {k: v for k, v in per_step.items() if v[1] > 0.001}
    total = sum(ms for _, ms in per_step.values())
    lines.append(f"GPU kernel time per decode step: {total:.2f} ms, against {step_ms:.2f} ms of wall time "
                 f"({total / step_ms:.0%} of the step)")
    lines += kernel_table(per_step, total)  # calls and ms per decode step
    import cProfile
    import io
    import pstats
    profiler = cProfile.Profile()
    profiler.runcall(run, 288)
    stream = io.StringIO()
    stats = pstats.Stats(profiler, stream=stream)
    stats.sort_stats("tottime").print_stats(40)
    # Where the step's host time goes by phase (scheduler, runner, sampler, outputs), and who makes the host-device
    # copies and reads that can wait for the GPU.
    stats.sort_stats("cumulative").print_stats(80)
    stats.print_callers(r"method '(to|copy_|tolist|item|cpu)' of 'torch")
    tag = f"{args.shape}_{args.model}" + ("" if args.state_dtype == "auto" else f"_{args.state_dtype}")
    (args.out / f"decode_profile_{tag}_python.txt").write_text(stream.getvalue())
    text = "\n".join(lines)
    print(text, flush=True)
    (args.out / f"decode_profile_{tag}.md").write_text(text + "\n")


if __name__ == "__main__":
    main()
