"""The SSE decode kernel's launch, swept: state tile width (BLOCK_V) x warps, for float32, bfloat16 and int16
(fixed point) state caches; and the GPU's own streaming bandwidth at several sizes.

    python bench/sse_decode_launch.py [--batch 256] [--heads 16] [--dtypes float32 bfloat16 int16] [--no-stream]
                                      [--out bench/results]

Launches `sse_decode_triton` with each launch override (K = 1 + shared, c = d_v = 128, bf16 inputs and decay
logits as vLLM passes them), each under CUDA-graph replay, and prints microseconds per layer and GB/s of state
traffic (the two touched states, read and written), after the GPU's in-place scale of as many bytes (`x.mul_`:
every byte read and written back where it was, as the kernel updates its states; the JSON's rows with BLOCK_V 0;
int16 moves bfloat16's bytes plus its scales and has no row of its own).
Then a device-to-device copy and the in-place scale from 64 MiB to 2 GiB (the JSON's `bandwidth`).
`sse_decode_triton` uses the launch this sweep found best on an H100 (a 32 KB state tile per program, 4 warps;
bench/results/sse_decode_launch_20261124{,b}.md, sse_decode_grid_order_20261127.md); rerun it on a new GPU kind
before changing that rule.
"""
import argparse
import json
import sys
from datetime import datetime, timezone
from functools import partial
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def decode_case(batch, H, N=4, c=128, dv=128, state_dtype=torch.float32):
    """One decode step's state cache (the batch's slots spread over twice as many, partition-major as vLLM lays it
    out: `sse_model.vllm_model.sse_state_shape`) and bf16 inputs, decay logits with their normalizer as vLLM passes
    them, named as `kernels.sse_decode` takes them. Returns (state, slots, inputs)."""
    from kernels import cache_rows
    state = torch.zeros(2 * batch, N + 1, H, cache_rows(c, state_dtype), dv, device="cuda", dtype=state_dtype)
    state = state.transpose(1, 2)
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


def time_launch(batch, H, N, c, dv, dtype, block_v, warps, **launch) -> tuple[float, float]:
    """(us per layer, GB/s of state traffic) of the decode kernel launched with BLOCK_V and warps (and any other
    keyword `sse_decode_triton` takes, for bench/sse_decode_ab.py's variants)."""
    from kernels.triton import sse_decode_triton
    state, slots, x = decode_case(batch, H, N, c, dv, dtype)
    out = torch.empty(batch, H, dv, device="cuda", dtype=torch.bfloat16)
    ms = replay_ms(lambda: sse_decode_triton(state, slots, **x, top_k=1, out=out, block_v=block_v, num_warps=warps,
                                             **launch))
    return ms * 1e3, state_bytes(state, batch) / ms / 1e6


def reference_row(batch, H, c, dv, dtype) -> dict:
    """The GPU's in-place scale of as many bytes as one decode step touches, each read and written back where it
    was: the bandwidth the kernel is held against, measured in the same run. (A device-to-device copy is no such
    reference: at power-of-two sizes from 512 MiB it ran at 2.4 TB/s where the in-place scale ran at 3.0,
    bench/results/sse_decode_bandwidth_20261127.md.)"""
    x = torch.ones(batch * H * 2 * c * dv, device="cuda", dtype=dtype)
    ms = replay_ms(partial(x.mul_, 1.0))
    return dict(dtype=str(dtype).split(".")[1], block_v=0, warps=0, us=ms * 1e3,
                gbs=2 * x.numel() * x.element_size() / ms / 1e6)


def stream_rows(mib_sizes=(64, 128, 256, 384, 512, 768, 1024, 2048)) -> list[dict]:
    """GB/s (read + written) of a device-to-device copy of MiB bytes and of an in-place scale of them."""
    rows = []
    for mib in mib_sizes:
        src = torch.ones(mib << 18, device="cuda")  # float32: MiB * 2**20 / 4 elements
        dst = torch.empty_like(src)
        for op, step in (("copy", partial(dst.copy_, src)), ("in-place scale", partial(src.mul_, 1.0))):
            ms = replay_ms(step)
            rows.append(dict(op=op, mib=mib, us=ms * 1e3, gbs=2 * (mib << 20) / ms / 1e6))
            print(f"{op:15s} {mib:5d} MiB: {rows[-1]['us']:8.1f} us {rows[-1]['gbs']:6.0f} GB/s", flush=True)
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16", "int16"])
    p.add_argument("--no-stream", action="store_true", help="skip the copy / in-place scale sizes")
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = p.parse_args()
    rows = []
    for dtype in (getattr(torch, name) for name in args.dtypes):
        if dtype.is_floating_point:
            rows.append(reference_row(args.batch, args.heads, 128, 128, dtype))
            print(f"{rows[-1]['dtype']:9s} in-place scale of the same bytes: {rows[-1]['us']:6.1f} us "
                  f"{rows[-1]['gbs']:6.0f} GB/s", flush=True)
        for block_v in (16, 32, 64, 128):
            for warps in (2, 4, 8):
                us, gbs = time_launch(args.batch, args.heads, 4, 128, 128, dtype, block_v, warps)
                rows.append(dict(dtype=str(dtype).split(".")[1], block_v=block_v, warps=warps, us=us, gbs=gbs))
                print(f"{rows[-1]['dtype']:9s} BLOCK_V {block_v:3d} warps {warps}: {us:7.1f} us {gbs:6.0f} GB/s",
                      flush=True)
    bandwidth = [] if args.no_stream else stream_rows()
    now = datetime.now(timezone.utc)
    args.out.mkdir(parents=True, exist_ok=True)
    report = dict(date=now.isoformat(timespec="seconds"), device=torch.cuda.get_device_name(), batch=args.batch,
                  heads=args.heads, rows=rows, bandwidth=bandwidth)
    (args.out / f"sse_decode_launch_{now:%Y%m%d}.json").write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
