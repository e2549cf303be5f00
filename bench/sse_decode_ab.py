"""The decode step of this tree against the same tree with kernel patches applied, timed in turn on one GPU.

    python bench/sse_decode_ab.py [--patch FILE ...] [--rounds 2] [--launch SPEC ...] [--batch 256] [--heads 16]
                                  [--out bench/results]

Each tree (this checkout as it is, "landed", and a copy per patch) is timed in its own process, the trees in turn,
`--rounds` times, so a drift of the GPU's clocks or of the host shows in every tree alike. A launch SPEC is
`dtype:BLOCK_VxWARPS` with optional `:name=value` extras, e.g. `int16:64x2`, `bfloat16:default`,
`int16:64x4:column_blocks=2:DECODE_STAGES=3`: an upper-case name sets that constant of kernels/triton/decode.py
(the patched module's, in that process), any other is a keyword argument of `sse_decode_triton`; a tree that does
not know a name skips that launch. Timing as `bench/sse_decode_launch.py` (batch 256, H = 16, c = d_v = 128, N = 4,
K = 1 + shared, a partition-major cache, CUDA-graph replay). Prints microseconds a layer per tree and launch
(median of the rounds, then each round) and writes them to `sse_decode_ab_<date>.json`. Untimed kernel variants are
kept as patches under bench/results/ (kernels/NOTES.md says which); this is how they are timed before landing.
"""
import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_LAUNCHES = ["int16:default", "int16:128x4", "bfloat16:default", "bfloat16:64x2"]


def parse_launch(spec: str) -> tuple[str, int | None, int | None, dict]:
    """`dtype:BLOCK_VxWARPS[:name=value...]` (or `dtype:default`) -> (dtype, block_v, warps, extras)."""
    dtype, shape, *extras = spec.split(":")
    block_v, warps = (None, None) if shape == "default" else map(int, shape.split("x"))
    return dtype, block_v, warps, {k: int(v) for k, v in (e.split("=") for e in extras)}


def time_tree(launches: list[str], batch: int, heads: int) -> None:
    """In a tree's own process (its kernels first on sys.path): one JSON line per launch."""
    import inspect

    import torch

    from kernels.triton import decode
    from sse_decode_launch import time_launch

    accepted = inspect.signature(decode.sse_decode_triton).parameters
    for spec in launches:
        dtype, block_v, warps, extras = parse_launch(spec)
        constants = {k: v for k, v in extras.items() if k.isupper()}
        kwargs = {k: v for k, v in extras.items() if not k.isupper()}
        if any(not hasattr(decode, k) for k in constants) or any(k not in accepted for k in kwargs):
            print(json.dumps(dict(launch=spec, us=None)), flush=True)
            continue
        landed = {name: getattr(decode, name) for name in constants}
        for name, value in constants.items():
            setattr(decode, name, value)
        us, _ = time_launch(batch, heads, 4, 128, 128, getattr(torch, dtype), block_v, warps, **kwargs)
        for name, value in landed.items():  # the next launch gets the module's own
            setattr(decode, name, value)
        print(json.dumps(dict(launch=spec, us=us)), flush=True)


def patched_tree(patch: Path, into: Path) -> Path:
    """A copy of this checkout's kernels/ and bench/ with `patch` applied (git apply, no repository needed)."""
    tree = into / patch.stem
    for part in ("kernels", "bench"):
        shutil.copytree(REPO / part, tree / part, ignore=shutil.ignore_patterns("results", "__pycache__"))
    subprocess.run(["git", "apply", "--include=kernels/*", "--include=bench/*.py", str(patch.resolve())], cwd=tree,
                   check=True)
    return tree


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--patch", type=Path, nargs="*", default=[])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--launch", nargs="+", default=DEFAULT_LAUNCHES)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    p.add_argument("--time-tree", type=Path, help=argparse.SUPPRESS)  # the per-tree process
    args = p.parse_args()
    if args.time_tree:
        sys.path[:0] = [str(args.time_tree), str(args.time_tree / "bench")]
        return time_tree(args.launch, args.batch, args.heads)

    import torch
    with tempfile.TemporaryDirectory() as tmp:
        trees = {"landed": REPO} | {patch.stem: patched_tree(patch, Path(tmp)) for patch in args.patch}
        us = {(name, spec): [] for name in trees for spec in args.launch}
        for round_ in range(args.rounds):
            for name, tree in trees.items():
                run = subprocess.run([sys.executable, __file__, "--time-tree", str(tree), "--batch", str(args.batch),
                                      "--heads", str(args.heads), "--launch", *args.launch],
                                     capture_output=True, text=True)
                if run.returncode:
                    sys.exit(f"timing {name} failed:\n{run.stderr[-4000:]}")
                for row in (json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")):
                    us[name, row["launch"]].append(row["us"])
                print(f"round {round_ + 1}: {name} done", flush=True)
    print(f"\nus a layer, batch {args.batch}, H {args.heads} (median of {args.rounds} rounds; the rounds)")
    print("| launch | " + " | ".join(trees) + " |\n| --- |" + " ---: |" * len(trees))
    for spec in args.launch:
        cells = []
        for name in trees:
            runs = us[name, spec]
            cells.append("skipped" if None in runs else
                         f"{statistics.median(runs):.1f} ({' '.join(f'{u:.1f}' for u in runs)})")
        print(f"| {spec} | " + " | ".join(cells) + " |")
    now = datetime.now(timezone.utc)
    args.out.mkdir(parents=True, exist_ok=True)
    report = dict(date=now.isoformat(timespec="seconds"), device=torch.cuda.get_device_name(), batch=args.batch,
                  heads=args.heads, patches=[str(p) for p in args.patch],
                  us={f"{name} {spec}": runs for (name, spec), runs in us.items()})
    (args.out / f"sse_decode_ab_{now:%Y%m%d-%H%M}.json").write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
