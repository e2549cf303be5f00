"""The SSE operator against its baselines: forward + backward (and forward alone) of every registered
implementation (bench/registry.py) over sequence lengths, on CUDA (medians of `triton.testing.do_bench`) or the CPU
(medians of wall time).

    python -m bench.op [--lengths 4096 16384 65536] [--ops sse_triton_indexed gla_chunk sdpa] [--against gla_chunk]
    python -m bench.op --device cpu --lengths 256 1024 --batch 4 --heads 4 --dim 32      # the CPU paths
    python -m bench.op --sections scaling_N indexed_kernels decode                       # CUDA only
    python -m bench.op --base REV [...]      # the same benchmark on revision REV's kernels, side by side
    python -m bench.op --baseline            # also overwrite bench/results/op_sse_vs_chunk_gla.json

Sections: `training` (the table above: each op's ms, and each op's time over `--against`'s), `scaling_N` (the
indexed op at T = 16k for N = 1..16 partitions, K = 1 + shared: it should stay flat), `indexed_kernels` (GPU time
of each kernel of the indexed op's forward + backward at T = 8k, torch profiler) and `decode` (the decode step for
a batch of 1..1024, against the device's copy bandwidth, next to softmax attention's decode over 4k-128k tokens).

`--base REV` checks REV out in a temporary `git worktree`, puts this checkout's bench/ in it, runs the same command
there in a process of its own (REV's kernels, this benchmark, the same shapes), then this checkout's, and prints
every timing of both with base / this. It replaces keeping unmerged kernels as patch files: commit a variant on a
branch and time it against the main line. The raw run goes to bench/runs/op_<date>.json (both sides with --base).
"""
import argparse
import functools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.baseline import REPO, command, cpu_name, now, raw_path, write_baseline
from bench.registry import OPS, Shape

BASELINE = "op_sse_vs_chunk_gla"
SECTIONS = ["training", "scaling_N", "indexed_kernels", "decode"]


def median_ms(fn, device: str, grad_to_none=None, repeats: int = 5) -> float:
    if device == "cuda":
        from triton.testing import do_bench
        return do_bench(fn, warmup=25, rep=100, grad_to_none=grad_to_none, return_mode="median")
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
        for t in grad_to_none or []:
            t.grad = None
    return statistics.median(times) * 1e3


def free(device: str):
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def time_op(name: str, shape: Shape) -> float | None:
    """ms of one call of op `name` at `shape`; None where the op cannot run here (not in this revision, a missing
    package, over its token limit)."""
    op = OPS[name]
    if not op.available(shape.device) or (op.max_tokens and shape.B * shape.T > op.max_tokens):
        return None
    try:
        step, leaves = op.build(shape)
        step()
    except (ValueError, ImportError) as e:  # e.g. an implementation the revision under test does not have
        print(f"{name}: {e}", file=sys.stderr)
        return None
    ms = median_ms(step, shape.device, grad_to_none=leaves, repeats=1 if name == "sse_reference" else 5)
    leaves.clear()  # frees the inputs before the cache is emptied
    free(shape.device)
    return ms


def training(args) -> list[dict]:
    rows = []
    for T in args.lengths:
        shape = Shape(T=T, B=args.batch, H=args.heads, C=args.dim, DV=args.dim, N=args.partitions, K=args.top_k,
                      device=args.device, dtype=torch.bfloat16 if args.device == "cuda" else torch.float32)
        row = {"T": T}
        for name in args.ops:
            row[f"{name} ms"] = time_op(name, shape)
            row[f"{name} fwd ms"] = time_op(name, Shape(**{**shape.__dict__, "backward": False}))
        for name in args.ops:
            if name != args.against and row.get(f"{name} ms") and row.get(f"{args.against} ms"):
                row[f"{name} / {args.against}"] = row[f"{name} ms"] / row[f"{args.against} ms"]
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def scaling_n(args) -> list[dict]:
    rows = [{"N": n, "sse_triton_indexed ms": time_op("sse_triton_indexed", Shape(T=16384, N=n))}
            for n in (1, 2, 4, 8, 16)]
    print(json.dumps(rows), flush=True)
    return rows


def indexed_kernels(args, T: int = 8192, steps: int = 5) -> dict:
    """GPU time of each kernel of the indexed op's forward + backward (torch profiler, per step): where to look
    before editing one."""
    step, leaves = OPS["sse_triton_indexed"].build(Shape(T=T))
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    kernels = {e.key: e.self_device_time_total / steps / 1e3 for e in prof.key_averages()
               if e.self_device_time_total > 0}
    leaves.clear()
    free("cuda")
    return {"T": T, "kernels_ms": dict(sorted(kernels.items(), key=lambda kv: -kv[1]))}


def copy_bandwidth() -> float:
    x = torch.empty(2 * 1024**3 // 4, device="cuda", dtype=torch.float32).normal_()
    y = torch.empty_like(x)
    ms = median_ms(functools.partial(y.copy_, x), "cuda")
    del x, y
    free("cuda")
    return 2 * 2 * 1024**3 / (ms * 1e-3)  # bytes read + written per second


def decode(args, N: int = 4, K: int = 1, H: int = 16, C: int = 128) -> list[dict]:
    """The decode step per batch: bytes = each touched state read and written once, as a share of the copy
    bandwidth; beside it softmax attention's one-query step over KV caches of 4k, 32k and 128k tokens."""
    from kernels.triton import sse_decode_triton
    bw, rows = copy_bandwidth(), []

    def bf16(*shape):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16)
    for B in (1, 64, 256, 1024):
        step = dict(q=bf16(B, H, C), k_logits=bf16(B, H, C), v=bf16(B, H, C),
                    log_decay=(torch.nn.functional.logsigmoid(torch.randn(B, H, C, device="cuda")) / 16).bfloat16(),
                    router_logits=torch.randn(B, N, device="cuda"), q_shared=bf16(B, H, C),
                    k_shared_logits=bf16(B, H, C))
        cache = torch.randn(B, H, N + 1, C, C, device="cuda")
        ms = median_ms(functools.partial(sse_decode_triton, cache, torch.randperm(B, device="cuda"), **step,
                                         top_k=K), "cuda")
        moved = 2 * B * (K + 1) * H * C * C * 4
        row = {"batch": B, "sse_decode ms": ms, "share of copy bandwidth": moved / (ms * 1e-3) / bw}
        del cache
        for L in (4096, 32768, 131072):
            if B * L * H * C * 2 * 2 <= 40 * 1024**3:  # KV caches over 40 GB are skipped
                attention = functools.partial(torch.nn.functional.scaled_dot_product_attention, bf16(B, H, 1, C),
                                              bf16(B, H, L, C), bf16(B, H, L, C))
                row[f"attention kv{L // 1024}k ms"] = median_ms(attention, "cuda")
                del attention
            free("cuda")
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def measure(args) -> dict:
    """Every asked section, in this process, with what the numbers depend on."""
    torch.manual_seed(0)
    device = (torch.cuda.get_device_name() if args.device == "cuda"
              else f"CPU {cpu_name()}, {torch.get_num_threads()} threads")
    result = dict(device=device, date=now().isoformat(timespec="seconds"), torch=torch.__version__)
    run = {"training": training, "scaling_N": scaling_n, "indexed_kernels": indexed_kernels, "decode": decode}
    for section in args.sections:
        if section != "training" and args.device != "cuda":
            raise SystemExit(f"section {section} needs CUDA")
        result[section] = run[section](args)
    return result


def on_revision(rev: str, argv: list[str]) -> dict:
    """`measure` on revision `rev`'s library with this checkout's bench/, in a temporary worktree and a process of
    its own."""
    with tempfile.TemporaryDirectory(prefix="bench-base-") as tmp:
        tree, out = Path(tmp) / "tree", Path(tmp) / "result.json"
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", "--quiet", str(tree), rev], check=True)
        try:
            shutil.rmtree(tree / "bench", ignore_errors=True)
            shutil.copytree(REPO / "bench", tree / "bench",
                            ignore=shutil.ignore_patterns("runs", "results", "__pycache__"))
            env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tree), os.environ.get("PYTHONPATH", "")]))
            subprocess.run([sys.executable, "-m", "bench.op", *argv, "--out", str(out)], cwd=tree, env=env, check=True)
            return json.loads(out.read_text())
        finally:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)], check=True)


def side_by_side(base: dict, this: dict, rev: str) -> str:
    """Every timing (keys ending in "ms") of both runs, row by row, with base / this (above 1: this is faster)."""
    lines = [f"| section | row | timing | {rev} | this | {rev} / this |", "| --- | --- | --- | ---: | ---: | ---: |"]
    for section in SECTIONS:
        for b, t in zip(base.get(section) or [], this.get(section) or []):
            if not isinstance(b, dict) or not isinstance(t, dict):
                continue
            label = next(f"{k} = {v}" for k, v in t.items() if not k.endswith("ms"))
            for key in (k for k in t if k.endswith("ms") and isinstance(t[k], float)):
                old, new = b.get(key), t[key]
                ratio = f"{old / new:.2f}" if isinstance(old, float) else "-"
                lines.append(f"| {section} | {label} | {key} | {'-' if old is None else f'{old:.3f}'} | {new:.3f} | "
                             f"{ratio} |")
    return "\n".join(lines)


def baseline_rows(result: dict) -> list[dict]:
    return [{k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items() if "fwd" not in k}
            for row in result["training"]]


def without(argv: list[str], *options: str) -> list[str]:
    """`argv` less `options` (`--name value`, `--name=value`, or a flag `--baseline`)."""
    kept, skip = [], False
    for a in argv:
        name = a.split("=", 1)[0]
        if skip or name in options:
            skip = not skip and name == a and name != "--baseline"
            continue
        kept.append(a)
    return kept


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384, 65536])
    p.add_argument("--ops", nargs="+", choices=sorted(OPS), help="default: the SSE default and the baselines that "
                   "run here")
    p.add_argument("--against", default="gla_chunk", choices=sorted(OPS), help="the op the ratios are over")
    p.add_argument("--sections", nargs="+", choices=SECTIONS, default=["training"])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--dim", type=int, default=128, help="c = d_v")
    p.add_argument("--partitions", type=int, default=4)
    p.add_argument("--top-k", type=int, default=1)
    p.add_argument("--base", metavar="REV", help="also time git revision REV (a worktree) and compare")
    p.add_argument("--baseline", action="store_true", help=f"overwrite bench/results/{BASELINE}.json")
    p.add_argument("--out", type=Path, help="the raw run's path (default bench/runs/op_<date>.json)")
    return p


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = parser().parse_args(argv)
    if args.ops is None:
        args.ops = (["sse_triton_indexed", "gla_chunk", "sdpa"] if args.device == "cuda"
                    else ["sse_chunk_torch_varlen", "sse_chunk_torch_mask", "sse_reference", "sdpa"])
        args.ops = [name for name in args.ops if OPS[name].available(args.device)]
    if args.base:
        base = on_revision(args.base, without(argv, "--base", "--out", "--baseline"))
    result = measure(args)
    out = args.out or raw_path("op", "json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"base": args.base, "base_result": base, "this": result} if args.base else result,
                              indent=1) + "\n")
    if args.base:
        print(side_by_side(base, result, args.base))
    if args.baseline:
        if "training" not in result or args.against not in args.ops:
            raise SystemExit("--baseline needs the training section and the --against op")
        ratio = f"sse_triton_indexed / {args.against}"
        longest = next(r for r in reversed(result["training"]) if r.get(ratio))
        write_baseline(BASELINE, device=result["device"], command=command("bench.op", argv),
                       title=f"SSE operator against {args.against}: forward + backward ms, bf16, H = {args.heads}, "
                             f"c = d_v = {args.dim}, N = {args.partitions}, K = {args.top_k} + shared, "
                             f"batch {args.batch}",
                       rows=baseline_rows(result),
                       headline={"label": f"SSE operator time / {args.against}'s, forward + backward, "
                                          f"{longest['T'] // 1024}k tokens", "value": round(longest[ratio], 2)})


if __name__ == "__main__":
    main()
