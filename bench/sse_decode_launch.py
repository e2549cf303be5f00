"""The SSE decode kernel's launch, swept: state tile width (BLOCK_V) x warps, for float32 and bfloat16 state caches.

    python bench/sse_decode_launch.py [--batch 256] [--heads 16] [--out bench/results]

Launches `kernels.triton.decode._decode_kernel` as `sse_decode_triton` does (K = 1 + shared, c = d_v = 128, bf16
inputs), each under CUDA-graph replay, and prints microseconds per layer and GB/s of state traffic (the two
touched states, read and written). `sse_decode_triton` uses the launch this sweep found best on an H100 (a 32 KB
state tile per program, 4 warps); rerun it on a new GPU kind before changing that rule.
"""
import argparse
import json
import sys
from datetime import datetime, timezone
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def time_launch(batch, H, N, c, dv, dtype, block_v, warps) -> tuple[float, float]:
    from kernels.triton.decode import _decode_kernel
    state = torch.zeros(2 * batch, H, N + 1, c, dv, device="cuda", dtype=dtype)
    slots = torch.randperm(2 * batch, device="cuda")[:batch].int()
    q, k, q_s, k_s = (torch.randn(batch, H, c, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    v = torch.randn(batch, H, dv, device="cuda", dtype=torch.bfloat16)
    g = -torch.rand(batch, H, c, device="cuda") / 16
    e = torch.randn(batch, N, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(batch, H, dv, device="cuda", dtype=torch.bfloat16)
    inputs = (q, k, v, g, e, q_s, k_s)

    def step():
        _decode_kernel[(batch, H, triton.cdiv(dv, block_v))](
            state, slots, *inputs, out, c**-0.5, H, c, dv, N, *state.stride(),
            *(t.stride(0) for t in (*inputs, out)), 1, True, 0, c, block_v, triton.next_power_of_2(N),
            num_warps=warps)
    step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    ms = triton.testing.do_bench(graph.replay, warmup=50, rep=300)
    moved = 2 * batch * H * 2 * c * dv * state.element_size()
    return ms * 1e3, moved / ms / 1e6


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = p.parse_args()
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        for block_v in (16, 32, 64, 128):
            for warps in (2, 4, 8):
                us, gbs = time_launch(args.batch, args.heads, 4, 128, 128, dtype, block_v, warps)
                rows.append(dict(dtype=str(dtype).split(".")[1], block_v=block_v, warps=warps, us=us, gbs=gbs))
                print(f"{rows[-1]['dtype']:9s} BLOCK_V {block_v:3d} warps {warps}: {us:7.1f} us {gbs:6.0f} GB/s",
                      flush=True)
    now = datetime.now(timezone.utc)
    args.out.mkdir(parents=True, exist_ok=True)
    report = dict(date=now.isoformat(timespec="seconds"), device=torch.cuda.get_device_name(), batch=args.batch,
                  heads=args.heads, rows=rows)
    (args.out / f"sse_decode_launch_{now:%Y%m%d}.json").write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
