"""Stage `eval`: avg@n (and pass@k, maj@n, lengths) of the last model on `data.eval`, through vLLM with the
SSE-H plugin. Resumes without regenerating finished problems."""
import os

from eval.runner import build_llm, evaluate


def eval_specs(cfg) -> list:
    """The `data.eval` entries: benchmark names (math500, aime24, ...), paths, or DataSources."""
    return list(cfg.data.eval)


def run(cfg, run_dir, model_path) -> dict:
    e, v = cfg.eval, cfg.grpo.vllm
    if v.kv_cache_gib is not None:
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(v.kv_cache_gib)

    def engine():
        return build_llm(model_path, seed=cfg.seed, dtype=v.dtype, gpu_memory_utilization=v.gpu_memory_utilization)

    results = evaluate(engine, eval_specs(cfg), run_dir.stage_dir("eval"), n=e.n, temperature=e.temperature,
                       top_p=e.top_p, max_tokens=e.max_tokens, seed=cfg.seed, limit=e.limit, model_name=model_path)
    headline = f"avg@{e.n}"
    run_dir.log_metrics("eval", 0, {f"{name}/{key}": value for name, m in results.items()
                                    for key, value in m.items() if isinstance(value, (int, float))})
    return {"output": None, "results": {name: m.get(headline) for name, m in results.items()},
            "summary": ", ".join(f"{name} {headline} {m.get(headline, float('nan')):.3f}"
                                 for name, m in results.items())}
