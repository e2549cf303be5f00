"""Where a GRPO step's time goes, from a run's metrics: rollout, scoring (and on several ranks the wait for the
others), update and weight push per step, with rollout tokens/s, GPU memory, the parity probe and the
sampler-vs-trainer KL (docs/pipeline.md, "On a GPU").

    python -m bench.grpo_phases RUN_DIR [--skip 1 6]     # --skip: steps left out of the medians (engine start,
                                                         # the first step after a resume)
    python -m bench.grpo_phases RUN_DIR --baseline --device "NVIDIA H200" --name gpu_small

Prints a markdown table (every step, then medians) and writes it beside the run's metrics as grpo_phases.md.
`--baseline` also overwrites bench/results/grpo_<name>.json: the table's rows, the median sampler-vs-trainer KL
its headline (a run's metrics do not name the GPU, hence `--device`).
"""
import argparse
import json
import statistics
import sys
from datetime import datetime, timezone
from pathlib import Path

from bench.baseline import command, write_baseline

COLUMNS = {  # metrics.jsonl key -> column
    "step_time": "step s",
    "time/rollout_s": "rollout s",
    "time/scoring_s": "scoring s",
    "time/rank_wait_s": "rank wait s",  # several ranks: rank 0's wait for the others' rollouts
    "time/update_s": "update s",
    "time/weight_push_s": "push s",
    "rollout_tokens_per_s": "rollout tokens/s",
    "gpu_memory/peak_allocated_gib": "peak GiB",
    "gpu_memory/reserved_gib": "reserved GiB",
    "vllm_parity": "parity",
    "sampling/kl_rollout_trainer": "KL",
}


def grpo_steps(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r for r in rows if r.get("stage") == "grpo" and "time/rollout_s" in r]


def rows(steps: list[dict], skip: set[int]) -> list[dict]:
    """A row per step, then the medians over the steps not in `skip`; every row has every column (None: not
    measured)."""
    out = [{"step": str(r["step"]), **{c: r.get(k) for k, c in COLUMNS.items()}} for r in steps]
    kept = [r for r in steps if r["step"] not in skip]
    out.append({"step": f"median{' (without ' + ', '.join(map(str, sorted(skip))) + ')' if skip else ''}",
                **{c: statistics.median(r[k] for r in kept if k in r) if any(k in r for r in kept) else None
                   for k, c in COLUMNS.items()}})
    return out


def table(steps: list[dict], skip: set[int]) -> str:
    def cell(value):
        return "" if value is None else f"{value:.3g}"
    lines = ["| step | " + " | ".join(COLUMNS.values()) + " |", "| ---: " + "| ---: " * len(COLUMNS) + "|"]
    lines += [f"| {r['step']} | " + " | ".join(cell(r[c]) for c in COLUMNS.values()) + " |" for r in rows(steps, skip)]
    return "\n".join(lines)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir", type=Path)
    p.add_argument("--skip", type=int, nargs="*", default=[1])
    p.add_argument("--baseline", action="store_true", help="overwrite bench/results/grpo_<name>.json")
    p.add_argument("--name", default="gpu_small", help="the baseline's configuration: grpo_<name>")
    p.add_argument("--device", help="the GPU the run ran on (with --baseline)")
    args = p.parse_args(argv)
    if args.baseline and not args.device:
        p.error("--baseline needs --device: a run's metrics do not name its GPU")
    steps = grpo_steps(args.run_dir)
    if not steps:
        raise SystemExit(f"{args.run_dir / 'metrics.jsonl'}: no GRPO step with phase timings (time/rollout_s)")
    text = table(steps, set(args.skip))
    print(text)
    (args.run_dir / "grpo_phases.md").write_text(text + "\n")
    if args.baseline:
        table_rows = [{k: v if isinstance(v, str) or v is None else float(f"{v:.3g}") for k, v in r.items()}
                      for r in rows(steps, set(args.skip))]
        kl = table_rows[-1]["KL"]
        write_baseline(f"grpo_{args.name}", device=args.device, command=command("bench.grpo_phases", argv),
                       date=datetime.fromtimestamp(steps[-1]["time"], timezone.utc).date().isoformat()
                       if "time" in steps[-1] else None,
                       title=f"GRPO steps of the run {args.run_dir.name}: phases (s), rollout tokens/s, GPU memory "
                             "(GiB), the parity probe and the sampler-vs-trainer KL",
                       rows=table_rows,
                       headline=None if kl is None else dict(label="sampler-vs-trainer KL, median of the GRPO steps",
                                                             value=kl))


if __name__ == "__main__":
    main()
