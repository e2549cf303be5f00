"""How far bfloat16 and int16 SSE state caches drift from float64 over a long decode, next to float32.

    python bench/state_dtype_drift.py [--steps 4096] [--out bench/results]

vLLM can store the SSE states in bfloat16 (`mamba_ssm_cache_dtype="bfloat16"`, sse_model/vllm_engine_config.py):
every decode step updates a state in float32 and rounds it back. A row whose decay is close to 1 keeps a long
memory, and an update smaller than half the state's last bfloat16 bit is lost, so the error grows with the
memory length. int16 states (16-bit fixed point with a float32 scale per state column, vLLM's default for a 16-bit
model: kernels/sse/decode.py) keep updates down to a part in 32,767 of their column's largest value. This runs
`kernels.sse_decode` (the torch twin, the same update and rounding as the Triton kernel) for one random sequence
with float64, float32, bfloat16 and int16 state caches, and reports the relative error of the
outputs against float64 in windows of steps, for two decay regimes: gate logits ~ N(0, 1) (decay ~0.96 per
step, a memory of ~25 tokens) and N(4, 1) (decay ~0.999, ~900 tokens). Inputs are float32 (K = 1 of N = 4
partitions plus the shared one, H = 2, c = 128, d_v = 64).
"""
import argparse
import json
import sys
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

H, C, DV, N, K = 2, 128, 64, 4, 1


def outputs(state_dtype, steps: int, gate_mean: float) -> torch.Tensor:
    from kernels import sse_decode, states_to_cache
    g = torch.Generator().manual_seed(0)
    state = states_to_cache(torch.zeros(1, H, N + 1, C, DV), state_dtype)
    slots, outs = torch.tensor([0]), []

    def draw(*shape, scale=1.0, mean=0.0):
        return torch.randn(1, *shape, generator=g) * scale + mean
    for _ in range(steps):
        step = dict(q=draw(H, C), k_logits=draw(H, C, scale=2.0), v=draw(H, DV), router_logits=draw(N),
                    log_decay=F.logsigmoid(draw(H, C, mean=gate_mean)) / 16, q_shared=draw(H, C),
                    k_shared_logits=draw(H, C, scale=2.0))
        outs.append(sse_decode(state, slots, **step, top_k=K, impl="torch")[0])
    return torch.stack(outs)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=4096)
    p.add_argument("--windows", type=int, default=4)
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    args = p.parse_args(argv)
    size = args.steps // args.windows
    results = {}
    for label, gate_mean in (("gates N(0,1)", 0.0), ("gates N(4,1)", 4.0)):
        ref = outputs(torch.float64, args.steps, gate_mean)
        for dtype in (torch.float32, torch.bfloat16, torch.int16):
            o = outputs(dtype, args.steps, gate_mean).double()
            results[f"{label}, {str(dtype)[6:]} states"] = [
                float((o[i:i + size] - ref[i:i + size]).norm() / ref[i:i + size].norm())
                for i in range(0, args.steps, size)]
    now = datetime.now(timezone.utc)
    heads = [f"steps {i}-{i + size}" for i in range(0, args.steps, size)]
    lines = [f"# SSE state dtype drift over {args.steps} decode steps ({now:%Y-%m-%d}, CPU, torch twin)", "",
             "Relative error of the SSE outputs against a float64 state cache, per window of steps.", "",
             "| case | " + " | ".join(heads) + " |", "| --- |" + " ---: |" * len(heads)]
    lines += [f"| {name} | " + " | ".join(f"{e:.1e}" for e in errs) + " |" for name, errs in results.items()]
    print("\n".join(lines))
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"state_dtype_drift_{now:%Y%m%d}"
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    stem.with_suffix(".json").write_text(json.dumps(dict(date=now.isoformat(timespec="seconds"), device="cpu",
                                                         steps=args.steps, shape=dict(H=H, c=C, d_v=DV, N=N, K=K),
                                                         relative_error=results), indent=2) + "\n")


if __name__ == "__main__":
    main()
