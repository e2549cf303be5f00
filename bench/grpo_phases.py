"""Where a GRPO step's time goes, from a run's metrics: rollout, scoring (and on several ranks the wait for the
others), update and weight push per step, with rollout tokens/s, GPU memory, the parity probe and the
sampler-vs-trainer KL (docs/pipeline.md, "On a GPU").

    python bench/grpo_phases.py RUN_DIR [--skip 1 6]     # --skip: steps left out of the medians (engine start,
                                                         # the first step after a resume)
Prints a markdown table (every step, then medians) and writes it beside the run's metrics as grpo_phases.md.
"""
import argparse
import json
import statistics
from pathlib import Path

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


def table(steps: list[dict], skip: set[int]) -> str:
    def cell(value):
        return "" if value is None else f"{value:.3g}"
    lines = ["| step | " + " | ".join(COLUMNS.values()) + " |", "| ---: " + "| ---: " * len(COLUMNS) + "|"]
    lines += [f"| {r['step']} | " + " | ".join(cell(r.get(k)) for k in COLUMNS) + " |" for r in steps]
    kept = [r for r in steps if r["step"] not in skip]
    medians = [statistics.median(r[k] for r in kept if k in r) if any(k in r for r in kept) else None
               for k in COLUMNS]
    lines.append(f"| median{' (without ' + ', '.join(map(str, sorted(skip))) + ')' if skip else ''} | "
                 + " | ".join(cell(m) for m in medians) + " |")
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("run_dir", type=Path)
    p.add_argument("--skip", type=int, nargs="*", default=[1])
    args = p.parse_args()
    steps = grpo_steps(args.run_dir)
    if not steps:
        raise SystemExit(f"{args.run_dir / 'metrics.jsonl'}: no GRPO step with phase timings (time/rollout_s)")
    text = table(steps, set(args.skip))
    print(text)
    (args.run_dir / "grpo_phases.md").write_text(text + "\n")


if __name__ == "__main__":
    main()
