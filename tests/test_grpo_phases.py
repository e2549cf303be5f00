"""bench/grpo_phases.py: a run's GRPO step split into phases (docs/pipeline.md, "On a GPU")."""
import json

import pytest

from bench import grpo_phases


def write_metrics(run_dir, steps):
    rows = [{"stage": "sft", "step": 1, "loss": 1.0}, {"stage": "grpo", "step": 0, "prompts": 8}]
    rows += [{"stage": "grpo", "step": s, "step_time": t, "time/rollout_s": t / 2, "time/update_s": t / 4}
             for s, t in steps]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_medians_leave_out_the_skipped_steps(tmp_path):
    write_metrics(tmp_path, [(1, 30.0), (2, 2.0), (3, 4.0), (4, 3.0)])
    steps = grpo_phases.grpo_steps(tmp_path)
    assert [r["step"] for r in steps] == [1, 2, 3, 4]  # SFT rows and the GRPO data row are not steps
    median = grpo_phases.table(steps, skip={1}).splitlines()[-1].split(" | ")
    assert median[0] == "| median (without 1)" and median[1:4] == ["3", "1.5", ""]  # no scoring metric: empty


def test_a_run_without_phase_timings_is_named(tmp_path, monkeypatch):
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"stage": "sft", "step": 1}) + "\n")
    monkeypatch.setattr("sys.argv", ["grpo_phases.py", str(tmp_path)])
    with pytest.raises(SystemExit, match="no GRPO step with phase timings"):
        grpo_phases.main()


def test_baseline_takes_the_median_kl_and_needs_the_device(tmp_path, monkeypatch, capsys):
    rows = [{"stage": "grpo", "step": s, "step_time": 2.0, "time/rollout_s": 1.0, "sampling/kl_rollout_trainer": kl,
             "time": 1795898883.0} for s, kl in [(1, 9e-5), (2, 1e-5), (3, 3e-5), (4, 2e-5)]]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(SystemExit):
        grpo_phases.main([str(tmp_path), "--baseline"])
    assert "--baseline needs --device" in capsys.readouterr().err
    monkeypatch.setattr("bench.baseline.RESULTS", tmp_path / "results")
    grpo_phases.main([str(tmp_path), "--baseline", "--device", "GPU X", "--name", "t"])
    baseline = json.loads((tmp_path / "results" / "grpo_t.json").read_text())
    assert baseline["headline"]["value"] == 2e-5  # steps 2-4: step 1 (the engine's start) is skipped
    assert baseline["device"] == "GPU X" and baseline["date"] == "2026-11-28"
    assert [r["step"] for r in baseline["rows"]] == ["1", "2", "3", "4", "median (without 1)"]
