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
