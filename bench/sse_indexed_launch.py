"""Launch sweep of the SSE training operator's chunk kernels (kernels/triton/indexed_chunk.py, `LAUNCH`): value columns
per program (BLOCK_V; key columns, BLOCK_C, for dq_dk_dg), Triton's num_warps and num_stages per kernel, one kernel
at a time (each keeps the best found before it), timed as the whole operator's forward+backward (bf16, N = 4, K = 1 +
shared, 16 heads of 128, one sequence of T tokens). Settings that do not fit the GPU (shared memory, registers) are
skipped. Ends with the shipped settings against the best found at every length of `--lengths`, in one run, and how
far the best settings' outputs and gradients move from the shipped ones'.

    python bench/sse_indexed_launch.py [--kernels output dv dq_dk_dg] [--sweep-T 32768] [--lengths 16384 65536]
                                       [--out bench/results]
"""
import argparse
import copy
import datetime
import json
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from kernels import sse_attention
from kernels.triton import indexed_chunk
from sse_op import DV, H, sse_inputs, time_sse  # the op benchmark's inputs and timing

CANDIDATES = {
    "scan": [dict(BLOCK_V=b, num_warps=w, num_stages=s) for b in (32, 64, 128) for w in (2, 4) for s in (1, 2)],
    "chunk_sums": [dict(BLOCK_V=128, num_warps=w, num_stages=s) for w in (4, 8) for s in (1, 2, 3)],
    **{name: [dict(BLOCK_V=b, num_warps=w, num_stages=s) for b in (64, 128) for w in (4, 8) for s in (2, 3)]
       for name in ("output", "dv")},
    "dq_dk_dg": [dict(BLOCK_C=c, BLOCK_V=b, num_warps=w, num_stages=s) for c in (64, 128) for b in (32, 64, 128)
                 for w in (4, 8) for s in (1, 2, 3)],
}


def outputs(T):
    """Output and input gradients of one forward+backward on fixed inputs."""
    torch.manual_seed(0)
    ins = sse_inputs(T, 4)
    do = torch.randn(1, T, H, DV, device="cuda", dtype=torch.bfloat16)
    o, _ = sse_attention(**ins, top_k=1, decay_normalizer=16.0, impl="triton_indexed")
    o.backward(do)
    return [o.detach().float()] + [x.grad.float() for x in ins.values()]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kernels", nargs="+", default=list(CANDIDATES), choices=list(CANDIDATES))
    p.add_argument("--sweep-T", type=int, default=32768)
    p.add_argument("--lengths", type=int, nargs="+", default=[16384, 65536])
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = p.parse_args()
    shipped = copy.deepcopy(indexed_chunk.LAUNCH)
    sweep = {}
    for name in args.kernels:
        rows = []
        for launch in CANDIDATES[name]:
            indexed_chunk.LAUNCH[name] = launch
            try:
                rows.append((time_sse("triton_indexed", args.sweep_T, 4), launch))
            except triton.runtime.errors.OutOfResources as e:
                print(f"{name:11s} {launch} does not fit: {e}", flush=True)
                torch.cuda.empty_cache()
                continue
            print(f"{name:11s} {launch} {rows[-1][0]:.3f} ms", flush=True)
        best_ms, best = min(rows, key=lambda r: r[0])
        indexed_chunk.LAUNCH[name] = best
        sweep[name] = [dict(ms=ms, **launch) for ms, launch in rows]
    best = copy.deepcopy(indexed_chunk.LAUNCH)

    final, drift = [], []
    for T in args.lengths:
        indexed_chunk.LAUNCH.update(copy.deepcopy(shipped))
        shipped_ms = time_sse("triton_indexed", T, 4)
        ref = outputs(T) if T == args.lengths[0] else None
        indexed_chunk.LAUNCH.update(copy.deepcopy(best))
        best_ms = time_sse("triton_indexed", T, 4)
        if ref is not None:
            drift = [float((a - b).norm() / b.norm().clamp_min(1e-30)) for a, b in zip(outputs(T), ref)]
        final.append(dict(T=T, shipped_ms=shipped_ms, best_ms=best_ms, speedup=shipped_ms / best_ms))
    result = dict(device=torch.cuda.get_device_name(), date=datetime.datetime.now(datetime.timezone.utc).isoformat(
        timespec="seconds"), sweep_T=args.sweep_T, shipped=shipped, best=best, sweep=sweep, final=final,
        relative_drift_output_and_grads=drift)
    lines = [f"# SSE indexed op launch sweep, {result['device']}, {result['date']}", "",
             f"shipped: {shipped}", f"best (sweep at T = {args.sweep_T}): {best}", "",
             "| T | shipped ms | best ms | speedup |", "| --- | --- | --- | --- |"]
    lines += [f"| {r['T']} | {r['shipped_ms']:.2f} | {r['best_ms']:.2f} | {r['speedup']:.3f} |" for r in final]
    lines += ["", f"relative drift of output and gradients, best vs shipped: {max(drift):.2e}"]
    print("\n".join(lines))
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"sse_indexed_launch_{datetime.date.today():%Y%m%d}"
    stem.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
