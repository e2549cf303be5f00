"""Fault points for the reliability tests (tests/test_reliability.py, docs/reliability.md).

`SSE_RL_FAULTS="sft.step@3:pause,grpo.checkpoint_write@2:kill"` makes the process that reaches point `sft.step`
at step 3 stop there, and the one that reaches `grpo.checkpoint_write` at step 2 kill itself with SIGKILL. Each
fault fires once per run directory (a marker in `<run>/faults/`, written before acting), so the resumed run
goes past it. `pause` sleeps until killed from outside: the test then SIGKILLs the driver at that exact moment.
Unset (normal use) it costs one environment lookup.

Points: `<stage>.step` (inside a training step, after the loss, before the optimizer), `<stage>.checkpoint_write`
(checkpoint files written, not yet renamed into place), `grpo.rollout` (before vLLM generates), `<stage>.end` (the
final model in place after the last checkpoint, the stage not yet reported done).
"""
import os
import signal
import time
from pathlib import Path


def fault_point(name: str, step: int, run_path) -> None:
    spec = os.environ.get("SSE_RL_FAULTS")
    if not spec:
        return
    for entry in spec.split(","):
        point, _, action = entry.strip().partition(":")
        if point != f"{name}@{step}":
            continue
        marker = Path(run_path) / "faults" / point
        if marker.exists():
            return
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text(f"{action} pid {os.getpid()}\n")
        if action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        while action == "pause":
            time.sleep(1)
