"""Stage `eval`: avg@n (and pass@k, maj@n, lengths) on `data.eval` through vLLM with the SSE-H plugin, for the
newest model of the run or for several stages' models side by side (`eval.models`). Resumes without
regenerating finished problems."""
import os

from eval.metrics import paired_change
from eval.runner import build_llm, evaluate, per_problem_accuracy


def models_to_score(cfg, run_dir, last_model: str) -> dict[str, str]:
    """{label: model directory}: "last" is the model the stage was handed, a stage name that stage's output."""
    return {name: last_model if name == "last" else run_dir.stage_output(name) for name in cfg.eval.models}


def run(cfg, run_dir, model_path) -> dict:
    e, v = cfg.eval, cfg.grpo.vllm
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine in this process: starts in seconds
    if v.kv_cache_gib is not None:
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(v.kv_cache_gib)
    headline = f"avg@{e.n}"
    results, summary, dirs = {}, [], {}
    for label, path in models_to_score(cfg, run_dir, model_path).items():
        def engine(path=path):
            return build_llm(path, seed=cfg.seed, dtype=v.dtype, gpu_memory_utilization=v.gpu_memory_utilization)

        out = run_dir.stage_dir("eval") if cfg.eval.models == ["last"] else run_dir.stage_dir("eval") / label
        dirs[label] = out
        scores = evaluate(engine, cfg.data.eval, out, n=e.n, temperature=e.temperature, top_p=e.top_p,
                          max_tokens=e.max_tokens, seed=cfg.seed, limit=e.limit, model_name=path)
        prefix = "" if label == "last" else f"{label}/"
        run_dir.log_metrics("eval", 0, {f"{prefix}{name}/{key}": value for name, m in scores.items()
                                        for key, value in m.items() if isinstance(value, (int, float))})
        results[label] = {name: m.get(headline) for name, m in scores.items()}
        summary += [f"{prefix}{name} {headline} {m.get(headline, float('nan')):.3f}" for name, m in scores.items()]
    summary += changes(run_dir, dirs, list(scores), e.n)
    return {"output": None, "results": results, "summary": ", ".join(summary)}


def changes(run_dir, dirs: dict, names: list[str], n: int) -> list[str]:
    """Each model against the one before it in `eval.models` (sft against init, grpo against sft), per dataset:
    the change in avg@n with its paired 95 % interval, logged and summarised."""
    lines, labels = [], list(dirs)
    accuracy = {(label, name): per_problem_accuracy(out, name, n) for label, out in dirs.items() for name in names}
    for before, after in zip(labels, labels[1:]):
        for name in names:
            a, b = accuracy[before, name], accuracy[after, name]
            change = paired_change(list(a.values()), [b[i] for i in a])
            low, high = change["change_ci95"]
            key = f"{after}-vs-{before}/{name}/avg@{n}_change"
            run_dir.log_metrics("eval", 0, {key: change["change"], f"{key}_ci95_low": low, f"{key}_ci95_high": high})
            lines.append(f"{after} vs {before} on {name} {change['change']:+.3f} (95 % CI {low:+.3f} to {high:+.3f})")
    return lines
