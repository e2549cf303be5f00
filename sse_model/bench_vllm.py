"""Generation throughput of SSE-H against a Transformer of the same width and depth (Qwen2 architecture) in the
same vLLM, and cache memory per sequence; one table, written to bench/results/ as JSON and markdown.

    python -m sse_model.bench_vllm [--lengths 256 1024 4096] [--batch-sizes 1 32] [--dtype bfloat16]

Both models have random weights (speed does not depend on them) and run with vLLM's defaults for the platform
(engine core and worker in their own processes, torch.compile), prefix caching off as in GRPO rollouts, greedy
decoding of exactly the requested number of tokens after a 32-token prompt, no detokenization. Memory rows are
computed from the configs: SSE-H keeps H x (N + 1) x c x d_v float32 per SSE layer per sequence, whatever the
length, plus the KV cache of its attention layers; the Transformer keeps KV for every layer. They are given for
the benchmarked model and for the paper's 2B configuration. vLLM rounds both up to whole cache blocks.
"""
import argparse
import json
import os
import platform
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from sse_model.configuration_sse import ATTENTION_LAYER, PRESETS, SSE_LAYER, SSEConfig, default_layer_types

# Scaled down so the whole run takes minutes on 2 CPU cores; same proportions as the paper's model (one
# attention layer in six, head dim = c = d_v, MLP 3x hidden, n4k1 with a shared partition).
BENCH_MODEL = dict(hidden_size=256, intermediate_size=768, num_hidden_layers=6, num_attention_heads=4,
                   num_key_value_heads=4, head_dim=64, vocab_size=8192, max_position_embeddings=8192)
SSE_OPTIONS = dict(sse_num_partitions=4, sse_top_k=1, sse_shared_partition=True, sse_lora_rank=16)
PROMPT_TOKENS = 32
KV_CACHE_BYTES = 2 << 30  # room for 32 sequences of 4k tokens of either model


def sse_config(**model) -> SSEConfig:
    return SSEConfig(**model, layer_types=default_layer_types(model["num_hidden_layers"]), **SSE_OPTIONS,
                     tie_word_embeddings=False)


def transformer_config(**model):
    from transformers import Qwen2Config
    return Qwen2Config(**model, tie_word_embeddings=False, use_sliding_window=False)


def cache_bytes_per_sequence(config, tokens: int, kv_bytes: int) -> int:
    """Recurrent state (float32, constant) plus attention KV (kv_bytes per element, linear in tokens)."""
    layer_types = getattr(config, "layer_types", None) or [ATTENTION_LAYER] * config.num_hidden_layers
    kv = 2 * config.num_key_value_heads * config.head_dim * kv_bytes * tokens
    total = 0
    for kind in layer_types:
        if kind == SSE_LAYER:
            total += 4 * config.sse_num_heads * config.num_sse_partitions_with_shared * config.sse_key_dim \
                * config.sse_value_dim
        else:
            total += kv
    return total


def save_random(config, path: Path) -> Path:
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    return path


def throughput(path: Path, batch_sizes, lengths, dtype: str) -> dict[tuple[int, int], float]:
    """Generated tokens per second for every (batch size, generation length)."""
    from vllm import LLM, SamplingParams

    longest = max(lengths) + PROMPT_TOKENS
    llm = LLM(model=str(path), skip_tokenizer_init=True, dtype=dtype, max_model_len=longest, seed=0,
              enable_prefix_caching=False, max_num_seqs=max(batch_sizes), kv_cache_memory_bytes=KV_CACHE_BYTES)
    g = torch.Generator().manual_seed(0)
    vocab = llm.llm_engine.model_config.get_vocab_size()

    def run(batch, length):
        prompts = [{"prompt_token_ids": torch.randint(0, vocab, (PROMPT_TOKENS,), generator=g).tolist()}
                   for _ in range(batch)]
        params = SamplingParams(temperature=0.0, max_tokens=length, min_tokens=length, ignore_eos=True,
                                detokenize=False)
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        assert all(len(o.outputs[0].token_ids) == length for o in outputs)
        return batch * length / elapsed

    for batch in batch_sizes:  # warm-up: compilation (a batch of one token is a shape of its own) and allocation
        run(batch, 16)
    results = {(b, n): run(b, n) for b in batch_sizes for n in lengths}
    del llm
    return results


def device_description() -> str:
    cpu = platform.processor() or platform.machine()
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    return f"{cpu}, {len(os.sched_getaffinity(0))} cores available"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[256, 1024, 4096])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args(argv)

    import vllm
    from sse_model.vllm_plugin import register
    register()  # also done by vLLM through the entry point; harmless here, needed before the install is live

    kv_bytes = torch.finfo(getattr(torch, args.dtype)).bits // 8
    models = {"SSE-H": sse_config(**BENCH_MODEL), "Qwen2": transformer_config(**BENCH_MODEL)}
    speed = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, config in models.items():
            speed[name] = throughput(save_random(config, Path(tmp) / name), args.batch_sizes, args.lengths,
                                     args.dtype)

    rows = [dict(measure="generation tokens/s", setting=f"batch {b}, {n} new tokens",
                 sse=speed["SSE-H"][b, n], transformer=speed["Qwen2"][b, n])
            for b in args.batch_sizes for n in args.lengths]
    paper = {"SSE-H": SSEConfig.from_preset("paper_2b"),
             "Qwen2": transformer_config(**{k: v for k, v in PRESETS["paper_2b"].items() if k in BENCH_MODEL})}
    for label, pair in (("bench model", models), ("paper 2B", paper)):
        for tokens in (4096, 32768):
            rows.append(dict(measure="cache MiB per sequence", setting=f"{label}, {tokens // 1024}k tokens",
                             sse=cache_bytes_per_sequence(pair["SSE-H"], tokens, kv_bytes) / 2**20,
                             transformer=cache_bytes_per_sequence(pair["Qwen2"], tokens, kv_bytes) / 2**20))
    for row in rows:
        row["ratio"] = row["sse"] / row["transformer"]

    now = datetime.now(timezone.utc)
    report = dict(date=now.isoformat(timespec="seconds"), device=device_description(), vllm=vllm.__version__,
                  torch=torch.__version__, dtype=args.dtype, prompt_tokens=PROMPT_TOKENS,
                  bench_model=dict(BENCH_MODEL, **SSE_OPTIONS, layer_types=models["SSE-H"].layer_types), rows=rows)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"vllm_sse_vs_qwen2_{now:%Y%m%d}"
    stem.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    lines = [f"# SSE-H vs Qwen2 in vLLM {vllm.__version__}", "",
             f"{report['date']}, {report['device']}, torch {torch.__version__}, {args.dtype}, random weights.",
             f"Bench model (both): hidden {BENCH_MODEL['hidden_size']}, {BENCH_MODEL['num_hidden_layers']} layers "
             f"(SSE-H: attention at {[i for i, t in enumerate(models['SSE-H'].layer_types) if t == ATTENTION_LAYER]}"
             f", n{SSE_OPTIONS['sse_num_partitions']}k{SSE_OPTIONS['sse_top_k']} + shared), "
             f"{BENCH_MODEL['num_attention_heads']} heads x {BENCH_MODEL['head_dim']}, vocab "
             f"{BENCH_MODEL['vocab_size']}; {PROMPT_TOKENS}-token prompts, greedy, prefix caching off.", "",
             "| measure | setting | SSE-H | Qwen2 | SSE-H / Qwen2 |", "| --- | --- | ---: | ---: | ---: |"]
    lines += [f"| {r['measure']} | {r['setting']} | {r['sse']:.1f} | {r['transformer']:.1f} | {r['ratio']:.2f} |"
              for r in rows]
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
