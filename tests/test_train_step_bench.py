"""bench/train_step.py's rounds: the models timed in turn, order reversed every other round, and SSE-H's ratio to
the fastest Qwen3 taken round by round (the timings themselves need a GPU node)."""
import pytest
import torch

from bench import train_step


@pytest.fixture
def timed(monkeypatch):
    """`measure` replaced by a log of the calls; each model's tokens/s per round from `speeds`."""
    calls, speeds = [], {}

    def fake(build, T, packed, checkpointing, steps):
        name = build()
        calls.append(name)
        speed = speeds[name][sum(c == name for c in calls) - 1]
        if speed is None:
            raise torch.OutOfMemoryError("fake")
        return dict(tokens_per_s=speed, peak_gib=speed / 1e4, step_ms=[T / speed * 1e3] * steps, host_ms=[1.0] * steps)
    monkeypatch.setattr(train_step, "measure", fake)
    builds = {name: (lambda name=name: name) for name in ("SSE-H", "Qwen3-flex", "Qwen3-fused-norm")}
    return builds, calls, speeds


def test_rounds_alternate_and_pair(timed):
    builds, calls, speeds = timed
    speeds.update({"SSE-H": [100.0, 90.0, 120.0], "Qwen3-flex": [50.0, 95.0, 60.0],
                   "Qwen3-fused-norm": [80.0, 60.0, 100.0]})
    out = train_step.rounds(builds, 8192, False, False, steps=2, count=3)
    assert calls == ["SSE-H", "Qwen3-flex", "Qwen3-fused-norm", "Qwen3-fused-norm", "Qwen3-flex", "SSE-H",
                     "SSE-H", "Qwen3-flex", "Qwen3-fused-norm"]
    # each round against that round's fastest Qwen3 (flex in round 2, fused-norm in rounds 1 and 3)
    assert out["paired"] == [1.25, round(90 / 95, 3), 1.2]
    assert out["SSE-H"]["tokens_per_s"] == 100.0 and out["SSE-H"]["rounds"] == [100, 90, 120]
    assert out["Qwen3-flex"]["peak_gib"] == pytest.approx(95 / 1e4)
    assert len(out["SSE-H"]["step_ms"]) == 6


def test_a_model_out_of_memory_in_any_round_has_no_figure(timed):
    builds, _, speeds = timed
    speeds.update({"SSE-H": [100.0, 100.0], "Qwen3-flex": [50.0, None], "Qwen3-fused-norm": [None, None]})
    out = train_step.rounds(builds, 32768, True, False, steps=1, count=2)
    assert out["Qwen3-flex"] is None and out["Qwen3-fused-norm"] is None
    assert "paired" not in out


def test_a_timing_alone_runs_the_script_in_a_process_of_its_own(monkeypatch):
    """`measure_alone` runs this script with --alone MODEL and the configuration, and reads the timing from the
    last line it prints; a null there is an out-of-memory, a failed process an error with its stderr."""
    import subprocess
    ran, replies = [], ['{"tokens_per_s": 5.0}', "null"]

    def fake_run(argv, **kwargs):
        ran.append(argv)
        if len(ran) == 3:
            return subprocess.CompletedProcess(argv, 1, "", "Traceback: boom")
        return subprocess.CompletedProcess(argv, 0, f"compiling...\n{replies[len(ran) - 1]}\n", "")
    monkeypatch.setattr(subprocess, "run", fake_run)
    assert train_step.measure_alone("SSE-H", 8192, True, False, 4) == {"tokens_per_s": 5.0}
    assert ran[0][1:] == [train_step.__file__, "--alone", "SSE-H", "--lengths", "8192", "--steps", "4", "--packed"]
    with pytest.raises(torch.OutOfMemoryError):
        train_step.measure_alone("Qwen3-flex", 32768, False, True, 4)
    assert ran[1][-1] == "--checkpointing"
    with pytest.raises(RuntimeError, match="boom"):
        train_step.measure_alone("SSE-H", 8192, False, False, 4)
