"""bench/rollouts.py: the report the rollout ratios come from, and its engine-step parser (the runs themselves
need a GPU node)."""
import argparse
import json
from datetime import datetime, timezone

import pytest

from bench import rollouts as vllm_rollouts


def run_args(out, **changes):
    return argparse.Namespace(**{**dict(shape="small", lengths=[1024], prompts=32, prompts_long=32, long_from=1 << 30,
                                        n=8, engine="{}", out=out, add=[], repeats=1, interleave=False,
                                        step_clock=False, host_profile=False),
                                 **changes})


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
    (saved,) = tmp_path.glob("rollouts_small_*.json")
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
    (saved,) = tmp_path.glob("rollouts_small_*.json")
    assert saved.name == "rollouts_small_20261127-1800.json"
    assert set(json.loads(saved.read_text())["results"]) == {"SSE-H", "Qwen3"}


def test_engine_steps_are_counted_between_the_timed_markers():
    log = "\n".join(["iteration elapsed time: 9.0 ms",  # warm-up: outside the markers
                     "TIMED SSE-H 1024 begin", "x iteration elapsed time: 1.5 ms", "y iteration elapsed time: 0.5 ms",
                     "TIMED SSE-H 1024 end", "iteration elapsed time: 7.0 ms",
                     "TIMED Qwen3 1024 begin", "z iteration elapsed time: 4.0 ms", "TIMED Qwen3 1024 end"])
    assert vllm_rollouts.step_waits(log, "SSE-H") == {"1024": dict(steps=2, waited_s=0.002, longest_ms=1.5)}
    assert vllm_rollouts.step_waits(log, "Qwen3") == {"1024": dict(steps=1, waited_s=0.004, longest_ms=4.0)}


def test_the_report_names_each_models_runner(tmp_path):
    runs = {"SSE-H": dict(result(12_000.0), model_runner="V2"), "SSE-H-v1-runner": dict(result(11_000.0),
                                                                                         model_runner="V1"),
            "Qwen3": dict(result(20_000.0), model_runner="V2")}
    markdown = vllm_rollouts.write_report(runs, run_args(tmp_path))
    assert "vLLM model runner: SSE-H V2, SSE-H-v1-runner V1, Qwen3 V2." in markdown
    assert cells(markdown, "output tokens/s, 32 prompts x 8 x 1024") == ["12,000", "11,000", "20,000", "0.60", "0.55"]


def fake_worker(monkeypatch, tps: dict, calls: list):
    """subprocess.run standing in for the worker process: records (command, environment), prints a RESULT line per
    model it was given with that model's tokens/s (a list: one per round), and vLLM's concurrency line per engine."""
    import subprocess

    def fake_run(cmd, stdout, env, **kwargs):
        calls.append((cmd, env))
        names = cmd[cmd.index("--names") + 1:cmd.index("--paths")]
        for i in range(len(names)):
            stdout.write(f"(EngineCore pid=1) Maximum concurrency for 1,280 tokens per request: {100 + i:.2f}x\n")
        for name in names:
            runs = [dict(tokens_per_s=t, seconds=1.0, prefill_s=0.1, decode_tokens_per_s=t) for t in tps[name]]
            speed = {"1024": dict(prompts=32, **vllm_rollouts.median_run(runs))}
            stdout.write(f"RESULT {name} " + json.dumps(dict(start_s=80.0, model_runner="V2", speed=speed)) + "\n")
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(vllm_rollouts.subprocess, "run", fake_run)


def test_the_v1_arm_runs_its_worker_with_vllms_v1_runner(tmp_path, monkeypatch):
    calls = []
    fake_worker(monkeypatch, {"SSE-H": [10_000.0], "SSE-H-v1-runner": [9_000.0]}, calls)
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    for name in ("SSE-H", "SSE-H-v1-runner"):
        vllm_rollouts.run_models([name], [tmp_path], run_args(tmp_path, timeout=60), tmp_path / f"{name}.log")
    envs = {cmd[cmd.index("--names") + 1]: env for cmd, env in calls}
    assert envs["SSE-H-v1-runner"]["VLLM_USE_V2_MODEL_RUNNER"] == "0"
    assert envs["SSE-H"]["VLLM_USE_V2_MODEL_RUNNER"] == "1"
    interleaved = run_args(tmp_path, timeout=60, interleave=True)
    with pytest.raises(ValueError, match="SSE-H-v1-runner"):  # one process cannot give it its own environment
        vllm_rollouts.run_models(["SSE-H-v1-runner", "Qwen3"], [tmp_path] * 2, interleaved, tmp_path / "x.log")


def test_interleaved_models_run_in_one_worker_and_pair_their_rounds(tmp_path, monkeypatch):
    calls = []
    fake_worker(monkeypatch, {"SSE-H": [30_000.0, 27_000.0, 24_000.0], "Qwen3": [31_000.0, 30_000.0, 26_000.0]},
                calls)
    args = run_args(tmp_path, timeout=60, interleave=True, repeats=3, models=["SSE-H", "Qwen3"], shape="small")
    monkeypatch.setattr("bench.baseline.RESULTS", tmp_path / "results")
    monkeypatch.setattr("bench.baseline.commit", lambda: "abc1234")  # subprocess.run is the fake worker here
    vllm_rollouts.main(["--shape", "small", "--lengths", "1024", "--repeats", "3", "--interleave",
                        "--out", str(tmp_path), "--baseline"])
    ((cmd, _),) = calls  # one worker for both models
    assert cmd[cmd.index("--names") + 1:cmd.index("--paths")] == ["SSE-H", "Qwen3"] and "--interleave" in cmd
    (saved,) = tmp_path.glob("rollouts_small_*.json")
    report = json.loads(saved.read_text())
    assert report["interleaved"] is True
    # each engine's concurrency line, in the order the engines started
    assert [report["results"][m]["max_concurrency"] for m in ("SSE-H", "Qwen3")] == [100.0, 101.0]
    markdown = saved.with_suffix(".md").read_text()
    assert cells(markdown, "output tokens/s, 32 prompts x 8 x 1024") == ["27,000", "30,000", "0.90"]
    # the rounds paired: 30/31, 27/30, 24/26
    assert "- SSE-H / Qwen3, 1024 new tokens, round by round: 0.97, 0.90, 0.92 (median 0.92)" in markdown
    assert "Interleaved (`--interleave`)" in markdown
    assert "round by round" not in vllm_rollouts.write_report(report["results"], dict_args(args, interleave=False))
    # --baseline: the configuration's one committed baseline, its headline the report's ratio
    baseline = json.loads((tmp_path / "results" / "rollouts_small_1k.json").read_text())
    assert baseline["headline"]["value"] == 0.9 and [r["model"] for r in baseline["rows"]] == ["SSE-H", "Qwen3"]
    assert baseline["command"].endswith("--interleave --out " + str(tmp_path)) and baseline["commit"] == "abc1234"


def dict_args(args, **changes):
    return argparse.Namespace(**{**vars(args), **changes})


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


def test_the_step_clock_summarises_decode_steps_and_the_report_lists_every_run(tmp_path):
    from bench import step_clock as vllm_step_clock
    # (host s, GPU ms at the step's first event, GPU ms at its sampled tokens, decode?): a prefill, then decode
    # steps every 10 ms of host time whose GPU work takes 8 ms and waits 2 ms for the host
    rows = [(0.0, 0.0, 30.0, False)] + [(0.03 + 0.01 * i, 30.0 + 10 * i, 38.0 + 10 * i, True) for i in range(5)]
    summary = vllm_step_clock.summarise(rows, gc_s=0.5, gc_full=1, kernels={"decode": 5.0, "gemm": 2.5})
    assert summary["decode_steps"] == 5 and summary["steps"] == 6
    assert summary["host_ms"] == pytest.approx(10.0)
    assert summary["span_ms"] == pytest.approx(8.0) and summary["idle_ms"] == pytest.approx(2.0)
    assert summary["kernel_ms"] == 7.5 and list(summary["top_kernels"]) == ["decode", "gemm"]
    off_gpu = vllm_step_clock.summarise([(r[0], None, None, r[3]) for r in rows], 0.0, 0, None)
    assert off_gpu["span_ms"] is None and off_gpu["kernel_ms"] is None
    assert "GPU span n/a" in vllm_step_clock.describe(off_gpu)
    runs = [dict(tokens_per_s=t, seconds=1.0, prefill_s=0.1, decode_tokens_per_s=t, step_clock=summary)
            for t in (30_000.0, 28_000.0)]
    sse_h = dict(result(1.0), speed={"1024": dict(prompts=32, **vllm_rollouts.median_run(runs))})
    markdown = vllm_rollouts.write_report({"SSE-H": sse_h, "Qwen3": result(30_000.0)}, run_args(tmp_path))
    line = ("- SSE-H, 1024 new tokens, run 2: 5 decode steps, one every 10.00 ms (host), GPU span 8.00 ms, GPU idle "
            "2.00 ms between steps; kernels 7.50 ms a step (decode 5.00, gemm 2.50); gc 0.50 s (1 full)")
    assert line in markdown


def test_the_step_clock_reaches_the_worker_and_lets_vllm_send_it(tmp_path, monkeypatch):
    calls = []
    fake_worker(monkeypatch, {"SSE-H": [10_000.0]}, calls)
    vllm_rollouts.run_models(["SSE-H"], [tmp_path], run_args(tmp_path, timeout=60, step_clock=True),
                             tmp_path / "x.log")
    ((cmd, env),) = calls
    assert "--step-clock" in cmd and env["VLLM_ALLOW_INSECURE_SERIALIZATION"] == "1"


def test_the_host_profile_needs_the_step_clock():
    with pytest.raises(SystemExit):
        vllm_rollouts.main(["--host-profile"])
