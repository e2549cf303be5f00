"""Stage `eval`: avg@n (and pass@k, maj@n, lengths) on `data.eval` through vLLM with the SSE-H plugin, for the
newest model of the run or for several stages' models side by side (`eval.models`). With
`resources.eval.num_workers` > 1 the samples are split over that many engines, one process each on its own
`num_gpus` GPUs (eval/workers.py). Resumes without regenerating finished samples."""
import dataclasses
import os

from eval.metrics import paired_change
from eval.runner import evaluate, per_problem_accuracy
from eval.state import state_report
from eval.workers import EngineProcesses, EngineSpec
from pipeline.config import eval_datasets
from pipeline.orchestrator import gpus_per_worker
from pipeline.rollouts import engine_dtype


def models_to_score(cfg, run_dir, last_model: str) -> dict[str, str]:
    """{label: model directory}: "last" is the model the stage was handed, a stage name that stage's output."""
    return {name: last_model if name == "last" else run_dir.stage_output(name) for name in cfg.eval.models}


def run(cfg, run_dir, model_path) -> dict:
    e = cfg.eval
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine in this process: starts in seconds
    settings = dataclasses.replace(e.vllm, dtype=engine_dtype(cfg, e.vllm))
    headline = f"avg@{e.n}"
    scores, dirs = {}, {}
    res = cfg.resources.eval
    for label, path in models_to_score(cfg, run_dir, model_path).items():
        spec = EngineSpec(path, settings, seed=cfg.seed)

        def progress(name, done, total, label=label):
            run_dir.write_progress("eval", done=done, total=total, unit="sample", what=f"{label} {name}")

        out = run_dir.stage_dir("eval") if cfg.eval.models == ["last"] else run_dir.stage_dir("eval") / label
        dirs[label] = out
        scores[label] = evaluate(spec.build, eval_datasets(cfg), out, n=e.n, temperature=e.temperature,
                                 top_p=e.top_p, max_tokens=e.max_tokens, seed=cfg.seed, limit=e.limit, model_name=path,
                                 engines=res.num_workers, launch=EngineProcesses(spec, int(gpus_per_worker(res))),
                                 progress=progress)
        prefix = "" if label == "last" else f"{label}/"
        run_dir.log_metrics("eval", 0, {f"{prefix}{name}/{key}": value for name, m in scores[label].items()
                                        for key, value in m.items() if isinstance(value, (int, float))})
        state = state_report(path, eval_datasets(cfg), out, e.state_problems) if e.state_problems else None
        if state:
            run_dir.log_metrics("eval", 0, {f"{prefix}{name}/state_entropy/{layer}/{p}": round(h, 4)
                                            for name, layers in state.items() for layer, row in enumerate(layers)
                                            for p, h in enumerate(row)})
    paired = changes(run_dir, dirs, list(next(iter(scores.values()))), e.n)  # every model: the same datasets
    summary = [f"{'' if label == 'last' else label + '/'}{name} {headline} "
               + (f"{m[headline]:.3f}" if m["num_problems"] else "-")
               + (f" ({m['skipped_problems']} problems skipped)" if m["skipped_problems"] else "")
               for label, by_name in scores.items() for name, m in by_name.items()]
    summary += [f"{after} vs {before} on {name} {c['change']:+.3f} (95 % CI {c['low']:+.3f} to {c['high']:+.3f})"
                for (before, after, name), c in paired.items()]
    return {"output": None, "results": {label: {name: m.get(headline) for name, m in by_name.items()}
                                        for label, by_name in scores.items()},
            "summary": ", ".join(summary), "table": table(scores, paired, e.n)}


def changes(run_dir, dirs: dict, names: list[str], n: int) -> dict[tuple[str, str, str], dict]:
    """Each model against the one before it in `eval.models` (sft against init, grpo against sft), per dataset:
    {(before, after, dataset): change in avg@n with its paired 95 % interval}, logged."""
    out, labels = {}, list(dirs)
    accuracy = {(label, name): per_problem_accuracy(path, name, n) for label, path in dirs.items() for name in names}
    for before, after in zip(labels, labels[1:]):
        for name in names:
            a, b = accuracy[before, name], accuracy[after, name]
            both = [i for i in a if i in b]  # a problem skipped for one model has nothing to pair
            if not both:
                continue
            change = paired_change([a[i] for i in both], [b[i] for i in both])
            low, high = change["change_ci95"]
            key = f"{after}-vs-{before}/{name}/avg@{n}_change"
            run_dir.log_metrics("eval", 0, {key: change["change"], f"{key}_ci95_low": low, f"{key}_ci95_high": high})
            out[before, after, name] = {"change": change["change"], "low": low, "high": high}
    return out


def table(scores: dict, paired: dict, n: int) -> str:
    """The console's and README's table: per model and dataset, avg@n with its interval, the paired change against
    the model before, pass@n and maj@n, in %, and the problems skipped (too long for the engine)."""
    change = {(after, name): c for (_, after, name), c in paired.items()}
    lines = [f"| model | dataset | avg@{n} (95 % CI) | change (95 % CI) | pass@{n} | maj@{n} | skipped |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for label, by_name in scores.items():
        for name, m in by_name.items():
            if not m["num_problems"]:
                lines.append(f"| {label} | {name} | - | | - | - | {m['skipped_problems']} |")
                continue
            low, high = m[f"avg@{n}_ci95"]
            c = change.get((label, name))
            moved = f"{100 * c['change']:+.1f} ({100 * c['low']:+.1f} to {100 * c['high']:+.1f})" if c else ""
            lines.append(f"| {label} | {name} | {100 * m[f'avg@{n}']:.1f} ({100 * low:.1f}-{100 * high:.1f}) | "
                         f"{moved} | {100 * m[f'pass@{n}']:.1f} | {100 * m[f'maj@{n}']:.1f} | "
                         f"{m['skipped_problems']} |")
    return "\n".join(lines)
