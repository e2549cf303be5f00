"""The recall comparison of issue 16 (docs/retrieval.md, "Three-way comparison"): MQAR accuracy against the
number of pairs for the runs of configs/mqar_*.yaml.

    for c in sse_h sse gla gla_pure transformer sse_dense; do sse-rl run configs/mqar_$c.yaml; done
    python -m bench.recall [--runs runs] [--out bench/runs] [--tag DATE] [--baseline]

Reads each run's eval `metrics.json` (query accuracy by number of pairs, Zoology's measure: teacher-forced, every
query of every sequence, with its 95 % bootstrap interval) and `<dataset>.samples.jsonl` (per problem, for paired
differences: every model answers the same problems), the parameter counts from the run's initial model and the
stage times from its manifest. Writes bench/runs/recall_<tag>.{png,md,json}: the plot (accuracy vs
pairs, 95 % CI error bars, one line per model, the chance and copying levels), the tables and, per number of
pairs, the paired difference of the comparisons the issue names with its 95 % interval (problems resampled with
both models' answers together). `--baseline` also overwrites bench/results/recall_mqar.json (a row per model) and
its plot recall_mqar.png.
"""
import argparse
import datetime
import json
import shutil
import sys
from collections import defaultdict
from pathlib import Path

from bench.baseline import REPO, RUNS, command, cpu_name, write_baseline
from eval.metrics import paired_change

BASELINE = "recall_mqar"

# (label, run name) in the order of the plot's legend and the table.
MODELS = [("Transformer", "mqar-zoology-transformer"), ("SSE-H", "mqar-zoology-sse-h"),
          ("SSE (all layers)", "mqar-zoology-sse"), ("SSE-H dense (K = N)", "mqar-zoology-sse-dense"),
          ("GLA", "mqar-zoology-gla"), ("GLA (all layers)", "mqar-zoology-gla-pure")]
# Paired differences reported per number of pairs: (a, b) gives a - b. The hybrids against each other, and the two
# models without attention (where the state alone must hold the pairs) against each other.
COMPARISONS = [("Transformer", "SSE-H"), ("SSE-H", "GLA"), ("SSE (all layers)", "GLA (all layers)"),
               ("SSE-H", "SSE-H dense (K = N)")]


def eval_dir(run_dir: Path) -> Path:
    """The folder of the run's eval metrics: eval/ for `eval.models: [last]`, else the one model's folder."""
    found = sorted((run_dir / "eval").glob("**/metrics.json"))
    if len(found) != 1:
        raise FileNotFoundError(f"{run_dir}: expected one eval metrics.json, found {len(found)}")
    return found[0].parent


def parameter_counts(model_dir: Path) -> dict | None:
    """{total, non_embedding} of the model saved at `model_dir` (built from its config, no weights read)."""
    if not (model_dir / "config.json").exists():
        return None
    from transformers import AutoConfig, AutoModelForCausalLM

    import sse_model  # noqa: F401

    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    total = sum(p.numel() for p in model.parameters())
    return {"total": total, "non_embedding": total - model.get_input_embeddings().weight.numel()}


def stage_seconds(run_dir: Path) -> dict:
    """{stage: seconds} from the run's manifest, where recorded: the driver's time for the whole stage, across
    Ray Train restarts (a stage's own result.json holds its last attempt only)."""
    manifest = run_dir / "manifest.json"
    stages = json.loads(manifest.read_text())["stages"] if manifest.exists() else {}
    return {stage: entry["seconds"] for stage, entry in stages.items() if entry.get("seconds") is not None}


def load_run(run_dir: Path) -> dict:
    """One run: its query accuracy by number of pairs (metrics.json), per-problem query accuracy and number of
    pairs (samples file), parameter counts and stage times."""
    out_dir = eval_dir(run_dir)
    metrics = json.loads((out_dir / "metrics.json").read_text())
    if len(metrics) != 1:
        raise ValueError(f"{out_dir}: expected one dataset, found {sorted(metrics)}")
    (dataset, m), = metrics.items()
    samples = defaultdict(list)
    for line in (out_dir / f"{dataset}.samples.jsonl").read_text().splitlines():
        if line.strip():
            s = json.loads(line)
            samples[s["id"]].append(s)
    problems = {pid: {"num_pairs": ss[0]["num_pairs"],
                      "query_accuracy": sum(sum(s["query_correct"]) / len(s["query_correct"]) for s in ss) / len(ss)}
                for pid, ss in samples.items()}
    return {"run": run_dir.name, "dataset": dataset,
            "query_accuracy": m["query_accuracy"], "query_accuracy_ci95": m["query_accuracy_ci95"],
            "by_num_pairs": [{"num_pairs": g["num_pairs"], "num_problems": g["num_problems"],
                              "accuracy": g["accuracy"], "ci95": g["ci95"]}
                             for g in m["query_accuracy_by_num_pairs"]],
            "problems": problems, "parameters": parameter_counts(run_dir / "init" / "model"),
            "seconds": stage_seconds(run_dir)}


def differences(runs: dict) -> list[dict]:
    """Per comparison (a, b) and number of pairs: mean of a - b over the shared problems with its paired 95 %
    interval, and whether the interval excludes 0."""
    out = []
    for a, b in COMPARISONS:
        if a not in runs or b not in runs:
            continue
        pa, pb = runs[a]["problems"], runs[b]["problems"]
        shared = sorted(set(pa) & set(pb))
        for pairs in sorted({pa[i]["num_pairs"] for i in shared}):
            ids = [i for i in shared if pa[i]["num_pairs"] == pairs]
            c = paired_change([pb[i]["query_accuracy"] for i in ids], [pa[i]["query_accuracy"] for i in ids])
            low, high = c["change_ci95"]
            out.append({"a": a, "b": b, "num_pairs": pairs, "num_problems": len(ids), "difference": c["change"],
                        "ci95": [low, high], "verdict": "a > b" if low > 0 else "a < b" if high < 0 else "overlap"})
    return out


def copying_level(pairs: int) -> float:
    """Per-query accuracy of a model that answers each query with one of the context's n values at random, 1 / n:
    that much needs no key-value binding (Zoology's format shows no answer, so no value can be ruled out as already
    given); recall is accuracy above it."""
    return 1 / pairs


def pct(fraction: float) -> str:
    """A fraction as the tables' percent (one decimal)."""
    return f"{100 * fraction:.1f}"


def markdown(runs: dict, diffs: list[dict], meta: dict) -> str:
    pairs = sorted({g["num_pairs"] for r in runs.values() for g in r["by_num_pairs"]})
    lines = [f"# MQAR comparison, {meta['date']}", "",
             f"Dataset `{next(iter(runs.values()))['dataset']}`; per-query accuracy in % (Zoology's measure: the "
             "greedy next token after each query key, teacher-forced) with the 95 % bootstrap interval over "
             "problems (sequences). Copying level: answering each query with any value of the context. "
             f"Machine: {meta['machine']}.", "",
             "| model | run | parameters (non-embedding) | SFT s | eval s | all | "
             + " | ".join(f"{p} pairs" for p in pairs) + " |",
             "| --- " * (6 + len(pairs)) + "|"]
    lines.append("| copying level | | | | | | " + " | ".join(pct(copying_level(p)) for p in pairs) + " |")
    for label, r in runs.items():
        by = {g["num_pairs"]: g for g in r["by_num_pairs"]}
        params = r["parameters"]
        cells = [f"{pct(by[p]['accuracy'])} ({pct(by[p]['ci95'][0])}-{pct(by[p]['ci95'][1])})" if p in by else ""
                 for p in pairs]
        low, high = r["query_accuracy_ci95"]
        lines.append(f"| {label} | {r['run']} | "
                     + (f"{params['total']:,} ({params['non_embedding']:,})" if params else "") + " | "
                     + " | ".join(f"{r['seconds'][s]:.0f}" if s in r["seconds"] else "" for s in ("sft", "eval"))
                     + f" | {pct(r['query_accuracy'])} ({pct(low)}-{pct(high)}) | " + " | ".join(cells) + " |")
    if diffs:
        lines += ["", "Paired differences (a - b, points of %, same problems, 95 % interval resampling problems):", "",
                  "| a | b | pairs | problems | a - b (95 % CI) | outside the CI |", "| --- " * 6 + "|"]
        for d in diffs:
            lines.append(f"| {d['a']} | {d['b']} | {d['num_pairs']} | {d['num_problems']} | "
                         f"{100 * d['difference']:+.1f} ({100 * d['ci95'][0]:+.1f} to {100 * d['ci95'][1]:+.1f}) | "
                         f"{d['verdict']} |")
    return "\n".join(lines) + "\n"


def plot(runs: dict, path: Path, title: str, values: int | None = None) -> None:
    """The plot; `values`: the task's number of value codes, for the chance lines."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=120)
    n = len(runs)
    for i, (label, r) in enumerate(runs.items()):
        by = r["by_num_pairs"]
        x = [g["num_pairs"] * (1 + 0.025 * (i - (n - 1) / 2)) for g in by]  # spread the bars a little
        y = [100 * g["accuracy"] for g in by]
        err = [[100 * (g["accuracy"] - g["ci95"][0]) for g in by], [100 * (g["ci95"][1] - g["accuracy"]) for g in by]]
        ax.errorbar(x, y, yerr=err, marker="o", capsize=3, label=label)
    pairs = sorted({g["num_pairs"] for r in runs.values() for g in r["by_num_pairs"]})
    if values:  # chance: any value of the vocabulary
        ax.axhline(100 / values, color="grey", linestyle="--", linewidth=1, label=f"chance (1/{values} values)")
    ax.plot(pairs, [100 * copying_level(p) for p in pairs], color="grey", linestyle=":", linewidth=1,
            label="copying: any value of the context")
    ax.set_xscale("log", base=2)  # the pairs double from entry to entry (4 to 32, or to 256 at Zoology's lengths)
    ax.set_xticks(pairs, [str(p) for p in pairs])
    ax.minorticks_off()
    ax.set_xlabel("key-value pairs in the context")
    ax.set_ylabel("query accuracy, % (95 % CI)")
    ax.set_ylim(-2, 102)
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", default=str(REPO / "runs"), help="the runs' parent folder")
    parser.add_argument("--out", default=str(RUNS), help="the raw run's folder")
    parser.add_argument("--baseline", action="store_true", help=f"overwrite bench/results/{BASELINE}.json and .png")
    parser.add_argument("--values", type=int, default=128, help="value codes of the task (vocab_size / 2: 128 in "
                        "configs/mqar_*.yaml), for the plot's chance line; 0: none")
    parser.add_argument("--tag", default=datetime.date.today().isoformat(), help="file name suffix")
    args = parser.parse_args(argv)
    runs = {}
    for label, name in MODELS:
        run_dir = Path(args.runs) / name
        if not list(run_dir.glob("eval/**/metrics.json")):  # not run, or its eval stage has not finished
            print(f"{run_dir}: no eval results, left out", file=sys.stderr)
            continue
        runs[label] = load_run(run_dir)
    if not runs:
        raise SystemExit(f"no runs of configs/mqar_*.yaml under {args.runs}")
    diffs = differences(runs)
    meta = {"date": args.tag, "machine": cpu_name()}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"recall_{args.tag}"
    dataset = next(iter(runs.values()))["dataset"]
    plot(runs, stem.with_suffix(".png"), f"MQAR ({dataset}), tiny models of matched size, SFT on CPU",
         values=args.values)
    text = markdown(runs, diffs, meta)
    stem.with_suffix(".md").write_text(text)
    result = {**meta, "runs": {label: {k: v for k, v in r.items() if k != "problems"} for label, r in runs.items()},
              "differences": diffs}
    stem.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    print(text)
    if args.baseline:
        saved = write_baseline(BASELINE, command=command("bench.recall", sys.argv[1:] if argv is None else argv),
                               **baseline(result))
        shutil.copyfile(stem.with_suffix(".png"), saved.with_suffix(".png"))
    return result


def baseline(result: dict) -> dict:
    """`write_baseline`'s arguments: a row per model, its query accuracy overall and per number of pairs (%)."""
    pairs = sorted({p["num_pairs"] for r in result["runs"].values() for p in r["by_num_pairs"]})
    rows = []
    for label, r in result["runs"].items():
        by_pairs = {p["num_pairs"]: p["accuracy"] for p in r["by_num_pairs"]}
        rows.append({"model": label, "query accuracy %": round(100 * r["query_accuracy"], 1),
                     **{f"{n} pairs %": None if n not in by_pairs else round(100 * by_pairs[n], 1) for n in pairs},
                     "non-embedding parameters": (r["parameters"] or {}).get("non_embedding"),
                     "SFT s": r["seconds"].get("sft")})
    dataset = next(iter(result["runs"].values()))["dataset"]
    return dict(device=result["machine"], date=result["date"][:10], rows=rows,
                title=f"MQAR recall ({dataset}): query accuracy of tiny models of matched size after SFT on the CPU, "
                      "one seed each (plot: recall_mqar.png)")


if __name__ == "__main__":
    main()
