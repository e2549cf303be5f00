"""Do bfloat16's logprob errors come from routing flips? A trained checkpoint in bfloat16 against itself in
float32, teacher-forced on held-out arithmetic text, on the CPU.

    python bench/route_flips.py [--checkpoint runs/tiny/grpo/final] [--sequences 40] [--out bench/results]

Per token: |log p_bf16 - log p_fp32| of the text's next token, and whether an SSE layer routes the token that
predicts it, or one of the k before, to another top-1 partition in bf16 than in float32 (a near tie of router
logits that bf16 flips). If flips carry the heavy tail, the largest differences follow a flip far more often than
tokens do on average. The model computes its router logits in float32 (`modeling_sse.float32_router`); the run is
repeated with them rounded to bf16, as the model and the vLLM backend computed them before (patched in here): the
gap between the two is what the float32 router buys. Writes
bench/results/route_flips_<checkpoint>_<date>.json/.md. (The GPU parity module, tests/test_vllm_gpu.py, records the same
route comparison for the largest vLLM-vs-trainer differences.)
"""
import argparse
import json
import sys
from datetime import datetime, timezone
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

T = 512  # tokens per sequence
WITHIN = (1, 4, 16)  # "a flip within k tokens before": k = 1 is the predicting token itself


def logprobs(model, ids: list[int]) -> torch.Tensor:
    x = torch.tensor([ids])
    return torch.log_softmax(model(x).logits[0, :-1].float(), -1).gather(-1, x[0, 1:, None])[:, 0]


def tokens_since_flip(flipped: torch.Tensor) -> torch.Tensor:
    """flipped [T] (any SSE layer) -> [T - 1]: for each predicted token p = 1..T-1, how many tokens back the
    nearest flip at or before its predicting token p - 1 lies (1 = at it; a large number when none)."""
    last, since = None, []
    for p in range(1, len(flipped)):
        if flipped[p - 1]:
            last = p - 1
        since.append(p - last if last is not None else 1 << 30)
    return torch.tensor(since)


@torch.no_grad()
def compare(fp32, bf16, sequences) -> dict:
    from sse_model.diagnostics import routed_partitions
    diffs, since, flips = [], [], []
    for ids in sequences:
        diffs.append((logprobs(bf16, ids) - logprobs(fp32, ids)).abs())
        flipped = (routed_partitions(fp32, ids) != routed_partitions(bf16, ids)).any(-1)  # [SSE layers, T]
        flips.append(flipped.float().mean())
        since.append(tokens_since_flip(flipped.any(0)))
    d, s = torch.cat(diffs), torch.cat(since)
    out = dict(tokens=d.numel(), route_flip_rate=float(torch.stack(flips).mean()), mean=float(d.mean()),
               p99=float(d.quantile(0.99)), max=float(d.max()))
    for name, chosen in (("all tokens", torch.ones_like(d, dtype=torch.bool)), ("top 1%", d >= d.quantile(0.99)),
                         ("top 0.1%", d >= d.quantile(0.999))):
        out[name] = {f"share with a flip within {k}": float((s[chosen] <= k).float().mean()) for k in WITHIN}
    return out


def router_rounded_to_model_dtype(layer_cls):
    """Patch `layer_cls.project` so that the router logits are rounded to x's dtype (a bf16 GEMM's output, as the
    model computed them before its float32 router); returns a function that undoes it."""
    original = layer_cls.project

    def project(self, x, token_mask=None, recipes=None):
        inputs, gate = original(self, x, token_mask, recipes)
        inputs["router_logits"] = inputs["router_logits"].to(x.dtype)
        return inputs, gate
    layer_cls.project = project
    return lambda: setattr(layer_cls, "project", original)


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--checkpoint", type=Path, default=REPO / "runs" / "tiny" / "grpo" / "final")
    p.add_argument("--sequences", type=int, default=40)
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    args = p.parse_args(argv)
    from transformers import AutoTokenizer

    from sse_model import SSEForCausalLM
    from sse_model.modeling_sse import SSELayer
    from tasks.generator import generate

    if not (args.checkpoint / "config.json").exists():
        raise SystemExit(f"{args.checkpoint}: no checkpoint there (run `sse-rl run configs/tiny.yaml` first)")
    tokenizer = AutoTokenizer.from_pretrained(args.checkpoint)
    rows = generate(600, levels=(1, 2, 3), seed=1, split="test")
    ids = tokenizer("\n".join(f"{r['problem']}\n{r['solution']}" for r in rows))["input_ids"]
    sequences = [ids[i:i + T] for i in range(0, len(ids) - T, T)][:args.sequences]
    fp32 = SSEForCausalLM.from_pretrained(args.checkpoint, dtype=torch.float32).eval()
    bf16 = SSEForCausalLM.from_pretrained(args.checkpoint, dtype=torch.bfloat16).eval()
    results = {"bf16 (router logits in float32)": compare(fp32, bf16, sequences)}
    undo = router_rounded_to_model_dtype(SSELayer)
    try:
        results["bf16, router logits rounded to bf16"] = compare(fp32, bf16, sequences)
    finally:
        undo()

    now = datetime.now(timezone.utc)
    name = args.checkpoint.relative_to(REPO) if args.checkpoint.is_relative_to(REPO) else args.checkpoint
    lines = [f"# bf16 against float32, {name}, {len(sequences)} x {T} tokens, CPU, {now:%Y-%m-%d %H:%M} UTC", "",
             "| | routes flipped | mean | p99 | max | "
             + " | ".join(f"{group}: flip within {k}" for group in ("all", "top 1%", "top 0.1%") for k in WITHIN)
             + " |", "| --- |" + " ---: |" * (4 + 3 * len(WITHIN))]
    for name, r in results.items():
        shares = [r[group][f"share with a flip within {k}"] for group in ("all tokens", "top 1%", "top 0.1%")
                  for k in WITHIN]
        lines.append(f"| {name} | {r['route_flip_rate']:.2%} | {r['mean']:.4f} | {r['p99']:.3f} | {r['max']:.2f} | "
                     + " | ".join(f"{x:.0%}" for x in shares) + " |")
    print("\n".join(lines))
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"route_flips_{'_'.join(args.checkpoint.parts[-2:])}_{now:%Y%m%d-%H%M}"
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    stem.with_suffix(".json").write_text(json.dumps(dict(date=now.isoformat(timespec="seconds"), device="cpu",
                                                         torch=torch.__version__, checkpoint=str(args.checkpoint),
                                                         sequences=len(sequences), tokens_per_sequence=T,
                                                         results=results), indent=2) + "\n")


if __name__ == "__main__":
    main()
