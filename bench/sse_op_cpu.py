"""CPU timings of the SSE paths (issue 2):

    python bench/sse_op_cpu.py

Forward+backward, float32, the CPU training path's regime (tiny models). Prints a table and writes
bench/results/sse_cpu_<date>.json with the machine and date.
"""
import datetime
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.machine import cpu_name  # noqa: E402
from kernels import sse_attention  # noqa: E402

SIZES = [  # (B, T, H, c=d_v, N, K)
    (4, 256, 4, 32, 4, 1),
    (4, 1024, 4, 32, 4, 1),
    (1, 4096, 4, 32, 4, 1),
    (4, 1024, 4, 32, 8, 2),
    (4, 1024, 4, 32, 4, 4),
    # The MQAR comparison's SFT batch (configs/mqar_*.yaml): 64 rows padded to 192 tokens; pad tokens cost the op
    # what real ones do. K = 1 is SSE-H and pure SSE, K = 4 = N the dense variant.
    (64, 192, 4, 32, 4, 1),
    (64, 192, 4, 32, 4, 2),
    (64, 192, 4, 32, 4, 4),
]
IMPLS = ["chunk_torch_varlen", "chunk_torch_mask", "reference"]
REFERENCE_MAX_TOKENS = 1024  # the token loop is for correctness, not speed: time it only where it finishes


def inputs(B, T, H, c, N):
    g = torch.Generator().manual_seed(0)

    def r(*shape):
        return torch.randn(*shape, generator=g).requires_grad_()
    return dict(q=r(B, T, H, c), k_logits=r(B, T, H, c), v=r(B, T, H, c),
                log_decay=(torch.nn.functional.logsigmoid(torch.randn(B, T, H, c, generator=g)) / 16).requires_grad_(),
                router_logits=r(B, T, N), q_shared=r(B, T, H, c), k_shared_logits=r(B, T, H, c))


def time_fwd_bwd(impl, x, K, repeats=5):
    do = torch.randn(x["v"].shape, generator=torch.Generator().manual_seed(1))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        o, _ = sse_attention(**x, top_k=K, impl=impl)
        (o * do).sum().backward()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2] * 1e3


def main():
    rows = []
    for B, T, H, c, N, K in SIZES:
        x = inputs(B, T, H, c, N)
        row = dict(B=B, T=T, H=H, c=c, N=N, K=K)
        for impl in IMPLS:
            if impl == "reference" and B * T > REFERENCE_MAX_TOKENS:
                row[impl] = None
                continue
            row[impl] = round(time_fwd_bwd(impl, x, K, repeats=1 if impl == "reference" else 5), 1)
        rows.append(row)
        print(" | ".join(f"{k}={v}" for k, v in row.items()), flush=True)
    result = dict(device=f"CPU {cpu_name()}, {torch.get_num_threads()} threads",
                  date=datetime.date.today().isoformat(), torch=torch.__version__, unit="ms fwd+bwd (median)",
                  rows=rows)
    out = Path("bench/results") / f"sse_cpu_{result['date']}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
