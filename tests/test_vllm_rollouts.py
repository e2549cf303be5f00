"""bench/vllm_rollouts.py: the report the rollout ratios come from, and its engine-step parser (the runs themselves
need a GPU node)."""
import argparse
import json
from datetime import datetime, timezone

from bench import vllm_rollouts


def run_args(out, **changes):
    return argparse.Namespace(**{**dict(shape="small", lengths=[1024], prompts=32, prompts_long=32, long_from=1 << 30,
                                        n=8, engine="{}", out=out, add=[], repeats=1), **changes})


def result(tokens_per_s, held=1000.0):
    return dict(start_s=80.0, max_concurrency=held,
                speed={"1024": dict(prompts=32, tokens_per_s=tokens_per_s, seconds=32 * 8 * 1024 / tokens_per_s,
                                    prefill_s=0.2, decode_tokens_per_s=tokens_per_s)},
                engine_steps={"1024": dict(steps=1025, waited_s=0.1, longest_ms=2.0)})


def cells(markdown, label):
    row = next(line for line in markdown.splitlines() if line.startswith(f"| {label}"))
    return [c.strip() for c in row.strip("|").split("|")][1:]


def test_ratios_to_qwen3_and_the_json_beside(tmp_path):
    markdown = vllm_rollouts.write_report({"SSE-H": result(10_000.0), "Qwen3": result(20_000.0)}, run_args(tmp_path))
    assert cells(markdown, "output tokens/s, 32 prompts x 8 x 1024") == ["10,000", "20,000", "0.50"]
    # bytes: the ratio is Qwen3's over SSE-H's, and SSE-H moves fewer per token at this size
    assert float(cells(markdown, "  decode MB moved per token")[2]) > 1
    assert "- SSE-H, 1024 new tokens: 1025 engine steps; the engine waited 0.1 s" in markdown
    (saved,) = tmp_path.glob("vllm_rollouts_small_*.json")
    assert json.loads(saved.read_text())["results"]["Qwen3"]["speed"]["1024"]["tokens_per_s"] == 20_000.0


def test_a_model_that_failed_did_not_run_or_lacks_a_figure_is_said_so(tmp_path):
    failed = vllm_rollouts.write_report({"SSE-H": result(10_000.0, held=None), "Qwen3": dict(error="exit 1")},
                                        run_args(tmp_path))
    assert cells(failed, "engine start, s") == ["80", "failed", ""]
    assert cells(failed, "max concurrent sequences")[:2] == ["n/a", "failed"]
    alone = vllm_rollouts.write_report({"SSE-H": result(10_000.0)}, run_args(tmp_path))
    assert cells(alone, "output tokens/s, 32 prompts x 8 x 1024") == ["10,000", "not run", ""]


def test_an_earlier_report_joins_the_table(tmp_path):
    vllm_rollouts.write_report({"Qwen3": result(20_000.0)}, run_args(tmp_path / "a"))
    (earlier,) = (tmp_path / "a").glob("*.json")
    markdown = vllm_rollouts.write_report({"SSE-H": result(30_000.0)}, run_args(tmp_path / "b", add=[earlier]))
    assert f"Qwen3 from the earlier run {earlier.name}." in markdown
    assert cells(markdown, "output tokens/s, 32 prompts x 8 x 1024") == ["30,000", "20,000", "1.50"]


def test_a_run_rewrites_one_report_after_each_model(tmp_path):
    args = run_args(tmp_path, started=datetime(2026, 11, 27, 18, 0, tzinfo=timezone.utc))
    first = vllm_rollouts.write_report({"SSE-H": result(10_000.0)}, args)
    assert cells(first, "output tokens/s, 32 prompts x 8 x 1024") == ["10,000", "not run", ""]
    vllm_rollouts.write_report({"SSE-H": result(10_000.0), "Qwen3": result(20_000.0)}, args)
    (saved,) = tmp_path.glob("vllm_rollouts_small_*.json")
    assert saved.name == "vllm_rollouts_small_20261127-1800.json"
    assert set(json.loads(saved.read_text())["results"]) == {"SSE-H", "Qwen3"}


def test_engine_steps_are_counted_between_the_timed_markers():
    log = "\n".join(["iteration elapsed time: 9.0 ms",  # warm-up: outside the markers
                     "TIMED 1024 begin", "x iteration elapsed time: 1.5 ms", "y iteration elapsed time: 0.5 ms",
                     "TIMED 1024 end", "iteration elapsed time: 7.0 ms"])
    assert vllm_rollouts.step_waits(log) == {"1024": dict(steps=2, waited_s=0.002, longest_ms=1.5)}


def test_the_report_names_each_models_runner(tmp_path):
    runs = {"SSE-H": dict(result(12_000.0), model_runner="V2"), "SSE-H-v1-runner": dict(result(11_000.0),
                                                                                         model_runner="V1"),
            "Qwen3": dict(result(20_000.0), model_runner="V2")}
    markdown = vllm_rollouts.write_report(runs, run_args(tmp_path))
    assert "vLLM model runner: SSE-H V2, SSE-H-v1-runner V1, Qwen3 V2." in markdown
    assert cells(markdown, "output tokens/s, 32 prompts x 8 x 1024") == ["12,000", "11,000", "20,000", "0.60", "0.55"]


def test_the_v1_arm_runs_its_worker_with_vllms_v1_runner(tmp_path, monkeypatch):
    import subprocess
    envs = {}

    def fake_run(cmd, stdout, env, **kwargs):
        envs[cmd[cmd.index("--name") + 1]] = env
        stdout.write("RESULT " + json.dumps(result(10_000.0)) + "\n")
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(vllm_rollouts.subprocess, "run", fake_run)
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    for name in ("SSE-H", "SSE-H-v1-runner"):
        vllm_rollouts.run_model(name, tmp_path, run_args(tmp_path, timeout=60), tmp_path / f"{name}.log")
    assert envs["SSE-H-v1-runner"]["VLLM_USE_V2_MODEL_RUNNER"] == "0"
    assert envs["SSE-H"]["VLLM_USE_V2_MODEL_RUNNER"] == "1"


def test_repeated_runs_report_the_median_and_the_spread(tmp_path):
    timed = [dict(tokens_per_s=tps, seconds=s, prefill_s=p, decode_tokens_per_s=tps)
             for tps, s, p in ((28_000.0, 9.4, 0.8), (25_000.0, 10.5, 0.9), (30_000.0, 8.7, 0.7))]
    median = vllm_rollouts.median_run(timed)
    assert (median["tokens_per_s"], median["seconds"], median["prefill_s"]) == (28_000.0, 9.4, 0.8)
    assert median["runs_tokens_per_s"] == [28_000.0, 25_000.0, 30_000.0]
    assert vllm_rollouts.median_run(timed[:2])["tokens_per_s"] == 25_000.0  # even count: the slower middle run
    sse_h = dict(result(28_000.0), speed={"1024": dict(prompts=32, **median)},
                 engine_steps={"1024": dict(steps=3075, waited_s=0.3, longest_ms=2.0)})
    markdown = vllm_rollouts.write_report({"SSE-H": sse_h, "Qwen3": result(30_000.0)}, run_args(tmp_path, repeats=3))
    assert cells(markdown, "output tokens/s, 32 prompts x 8 x 1024") == ["28,000", "30,000", "0.93"]
    assert cells(markdown, "  slowest / fastest of 3 runs")[0] == "0.833"
    assert "3075 engine steps; the engine waited 0.3 s for model outputs (longest 2 ms) of 28.6 s (3 runs)" in markdown
