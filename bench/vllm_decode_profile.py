"""Where one decode step of a rollout batch goes, in vLLM with its default compiled engine (CUDA graphs on).

    python bench/vllm_decode_profile.py --model SSE-H|Qwen3 [--shape small|1b] [--batch 256] [--out DIR]

The engine runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0) so torch.profiler sees its kernels. It prints
(1) the decode step time, from two runs that differ only in their number of new tokens, and (2) the GPU time per
kernel over 32 decode steps, sorted, with the share of each; the same tables go to DIR.
"""
import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))


def decode_kernel_alone(batch, H=8, N=4, c=128, dv=128) -> str:
    """kernels.sse_decode by itself on a state cache like vLLM's (bf16 inputs, float32 states), CUDA-graph replay."""
    import triton

    import kernels
    state = torch.zeros(4 * batch, H, N + 1, c, dv, device="cuda")
    slots = torch.randperm(4 * batch, device="cuda")[:batch]
    x = {name: torch.randn(batch, H, c, device="cuda", dtype=torch.bfloat16)
         for name in ("q", "k_logits", "q_shared", "k_shared_logits")}
    x["v"] = torch.randn(batch, H, dv, device="cuda", dtype=torch.bfloat16)
    x["log_decay"] = -torch.rand(batch, H, c, device="cuda") / 16
    x["router_logits"] = torch.randn(batch, N, device="cuda", dtype=torch.bfloat16)

    def step():
        kernels.sse_decode(state, slots, **x, top_k=1)
    step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    ms = triton.testing.do_bench(graph.replay)
    moved = 2 * batch * H * 2 * c * dv * 4  # K + shared partitions, read and written, float32
    return (f"sse_decode alone, batch {batch}, H {H}, N {N}, c = d_v = {c}: {ms * 1e3:.1f} us per layer, "
            f"{moved / ms / 1e6:.0f} GB/s of state traffic")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="SSE-H")
    p.add_argument("--shape", default="small")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--out", type=Path, default=Path("/tmp"))
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import tempfile

    from transformers import AutoModelForCausalLM
    from vllm import LLM, SamplingParams

    from vllm_rollouts import COMMON, PROMPT_TOKENS, configs  # configs() imports sse_model: registers sse_hybrid

    path = Path(tempfile.mkdtemp()) / args.model
    torch.manual_seed(0)
    config = configs(args.shape)[args.model]
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(path)
    llm = LLM(model=str(path), skip_tokenizer_init=True, dtype="bfloat16", seed=0, max_model_len=2048)
    prompts = [{"prompt_token_ids": torch.randint(0, COMMON["vocab_size"], (PROMPT_TOKENS,)).tolist()}
               for _ in range(args.batch)]

    def run(new_tokens):
        params = SamplingParams(temperature=1.0, max_tokens=new_tokens, min_tokens=new_tokens, ignore_eos=True,
                                detokenize=False)
        t = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - t

    run(16)
    short, long = run(32), run(288)
    step_ms = (long - short) / 256 * 1e3
    lines = [decode_kernel_alone(args.batch, H=config.sse_num_heads)] if args.model == "SSE-H" else []
    lines += [f"{args.model} ({args.shape}), batch {args.batch}: decode step {step_ms:.2f} ms "
             f"({args.batch / step_ms * 1e3:,.0f} tokens/s in steady decode); 32 tokens took {short:.2f} s"]
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run(33)  # the prefill step and 32 decode steps
    events = [e for e in prof.key_averages() if e.device_time_total > 0 and e.device_type.name == "CUDA"]
    total = sum(e.device_time_total for e in events)
    lines.append(f"GPU kernel time over the profiled run: {total / 1e3:.1f} ms")
    lines.append("| kernel | calls | total ms | share |")
    lines.append("| --- | ---: | ---: | ---: |")
    for e in sorted(events, key=lambda e: -e.device_time_total)[:25]:
        lines.append(f"| {e.key[:90]} | {e.count} | {e.device_time_total / 1e3:.2f} | "
                     f"{e.device_time_total / total:.1%} |")
    steps = 33
    lines.append(f"GPU kernel time per step (prefill included): {total / 1e3 / steps:.2f} ms, "
                 f"against {step_ms:.2f} ms of wall time per decode step")
    import cProfile
    import io
    import pstats
    profiler = cProfile.Profile()
    profiler.runcall(run, 33)
    stream = io.StringIO()
    pstats.Stats(profiler, stream=stream).sort_stats("tottime").print_stats(40)
    (args.out / f"decode_profile_{args.shape}_{args.model}_python.txt").write_text(stream.getvalue())
    text = "\n".join(lines)
    print(text, flush=True)
    (args.out / f"decode_profile_{args.shape}_{args.model}.md").write_text(text + "\n")
    cpu = prof.key_averages().table(sort_by="cpu_time_total", row_limit=30)
    (args.out / f"decode_profile_{args.shape}_{args.model}_cpu.txt").write_text(cpu)


if __name__ == "__main__":
    main()
