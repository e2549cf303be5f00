"""The SSE decode kernel's launch, swept: state tile width (BLOCK_V) x warps, for float32 and bfloat16 state caches.

    python bench/sse_decode_launch.py [--batch 256] [--heads 16] [--out bench/results]

Launches `sse_decode_triton` with each launch override (K = 1 + shared, c = d_v = 128, bf16 inputs and decay
logits as vLLM passes them), each under CUDA-graph replay, and prints microseconds per layer and GB/s of state
traffic (the two touched states, read and written), after the GPU's device-to-device copy of as many bytes (the
JSON's rows with BLOCK_V 0). `sse_decode_triton` uses the launch this sweep found best on an H100 (a 32 KB state
tile per program, 4 warps; bench/results/sse_decode_launch_20261124{,b}.md, sse_decode_grid_order_20261127.md);
rerun it on a new GPU kind before changing that rule.
"""
import argparse
import json
import sys
from datetime import datetime, timezone
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def decode_case(batch, H, N=4, c=128, dv=128, state_dtype=torch.float32):
    """One decode step's state cache (the batch's slots spread over twice as many) and bf16 inputs, decay logits
    with their normalizer as vLLM passes them, named as `kernels.sse_decode` takes them. Returns (state, slots,
    inputs)."""
    state = torch.zeros(2 * batch, H, N + 1, c, dv, device="cuda", dtype=state_dtype)
    slots = torch.randperm(2 * batch, device="cuda")[:batch].int()
    inputs = {name: torch.randn(batch, H, c, device="cuda", dtype=torch.bfloat16)
              for name in ("q", "k_logits", "q_shared", "k_shared_logits")}
    inputs["v"] = torch.randn(batch, H, dv, device="cuda", dtype=torch.bfloat16)
    inputs["log_decay"] = torch.randn(batch, H, c, device="cuda", dtype=torch.bfloat16) + 4  # decay logits
    inputs["decay_normalizer"] = 16.0
    inputs["router_logits"] = torch.randn(batch, N, device="cuda", dtype=torch.bfloat16)
    return state, slots, inputs


def replay_ms(step) -> float:
    """Milliseconds per call of `step` captured in a CUDA graph (as vLLM runs decode)."""
    step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return triton.testing.do_bench(graph.replay, warmup=50, rep=300)


def state_bytes(state, batch) -> int:
    """Bytes a decode step moves: the K = 1 routed and the shared partition's states, read and written."""
    _, H, _, c, dv = state.shape
    return 2 * batch * H * 2 * c * dv * state.element_size()


def time_launch(batch, H, N, c, dv, dtype, block_v, warps) -> tuple[float, float]:
    """(us per layer, GB/s of state traffic) of the decode kernel launched with BLOCK_V and warps."""
    from kernels.triton import sse_decode_triton
    state, slots, x = decode_case(batch, H, N, c, dv, dtype)
    out = torch.empty(batch, H, dv, device="cuda", dtype=torch.bfloat16)
    ms = replay_ms(lambda: sse_decode_triton(state, slots, **x, top_k=1, out=out, block_v=block_v, num_warps=warps))
    return ms * 1e3, state_bytes(state, batch) / ms / 1e6


def copy_row(batch, H, c, dv, dtype) -> dict:
    """The GPU's device-to-device copy of as many bytes as one decode step touches, read and written: the
    bandwidth the kernel is held against, measured in the same run."""
    src = torch.randn(batch * H * 2 * c * dv, device="cuda").to(dtype)
    dst = torch.empty_like(src)
    ms = replay_ms(lambda: dst.copy_(src))
    return dict(dtype=str(dtype).split(".")[1], block_v=0, warps=0, us=ms * 1e3,
                gbs=2 * src.numel() * src.element_size() / ms / 1e6)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = p.parse_args()
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        rows.append(copy_row(args.batch, args.heads, 128, 128, dtype))
        print(f"{rows[-1]['dtype']:9s} copy of the same bytes:   {rows[-1]['us']:7.1f} us {rows[-1]['gbs']:6.0f} GB/s",
              flush=True)
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
