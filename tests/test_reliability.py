"""Reliability (issue 8, and issue 6 item 5): fault injection and the bad-input matrix. docs/reliability.md lists
the guarantees these tests show.

The fault-injection tests run the real pipeline (`sse-rl` in a subprocess: Ray, Ray Train, TRL, vLLM CPU rollouts,
real checkpoints) on tests/reliability.yaml, kill it at chosen moments through the fault points of
pipeline/faults.py, resume, and compare with an uninterrupted run. Every process a test starts carries a tag in its
environment, which Ray's daemons and workers, vLLM and the grader pool inherit: that is how a test finds what it
leaked and cleans up after itself without touching anyone else's processes (`ray stop` would kill every Ray
instance on the machine).

The bad-input tests run stage code in-process on a very small model, without Ray.
"""
import errno
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
CONFIG = REPO / "tests" / "reliability.yaml"
TAG = "SSE_RL_TEST_TAG"
# Per-attempt numbers: wall-clock times (GRPO's phase times `time/...` and rollout speed too), and the Trainer's
# `train_loss`, the mean loss of the steps run by the last `train()` call (after a resume, only the steps since the
# checkpoint).
PER_ATTEMPT = {"time", "step_time", "train_runtime", "train_samples_per_second", "train_steps_per_second",
               "train_loss", "rollout_tokens_per_s"}


# ---------------------------------------------------------------------------------------------------- processes

def tagged(tag: str) -> list[int]:
    """Live processes whose environment carries `tag` (a zombie's environment reads empty)."""
    needle = f"{TAG}={tag}".encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if needle in (entry / "environ").read_bytes().split(b"\0"):
                    pids.append(int(entry.name))
            except OSError:  # exited meanwhile
                pass
    return pids


# Ray's agents of a killed driver's instance exit on their own, up to about a minute later; they touch no run.
RAY_AGENTS = ("ray::DashboardAgent", "ray::RuntimeEnvAgent")


def wait_gone(tag: str, timeout: float, besides: tuple[str, ...] = ()) -> list[str]:
    """Wait for the tagged processes to exit, except those whose command line starts with one of `besides`;
    return the ones left, described."""
    deadline = time.monotonic() + timeout
    while True:
        left = [f"{pid} {name}" for pid in tagged(tag) if not (name := _name(pid)).startswith(besides)]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.5)


def kill_tagged(tag: str, sig=signal.SIGKILL) -> None:
    for pid in tagged(tag):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _name(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:120]
    except OSError:
        return "?"


@pytest.fixture
def tag():
    """A tag for the processes of one test. Whatever is still running at the end is killed, and fails the test."""
    value = uuid.uuid4().hex
    yield value  # pytest comes back here whether the test passed or not
    left = wait_gone(value, timeout=30)
    kill_tagged(value)
    assert not left, f"processes left behind: {left}"


def tagged_env(tag: str, **extra) -> dict:
    env = dict(os.environ, **{TAG: tag}, RAY_DEDUP_LOGS="0", **extra)  # no dedup: every worker's line is kept
    env.pop("RAY_ADDRESS", None)
    return env


class Driver:
    """`sse-rl ARGS` in a session of its own, output in a log file."""

    def __init__(self, args: list, tag: str, log: Path, faults: str = ""):
        self.log = log
        with open(log, "w") as out:
            self.proc = subprocess.Popen([BIN / "sse-rl", *map(str, args)], cwd=REPO, stdout=out,
                                         stderr=subprocess.STDOUT, start_new_session=True,
                                         env=tagged_env(tag, SSE_RL_FAULTS=faults))

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def finish(self, timeout: float = 600) -> str:
        assert self.proc.wait(timeout) == 0, self.output()[-4000:]
        return self.output()

    def kill_when(self, marker: Path, group: bool, timeout: float = 600) -> str:
        """Wait until a `pause` fault point holds the run (its marker appears), then SIGKILL the driver alone (what
        `kill -9 PID` or the OOM killer does) or its whole process group (`kill -9 -PGID`, a job scheduler)."""
        deadline = time.monotonic() + timeout
        while not marker.exists():
            assert self.proc.poll() is None, f"the run ended before {marker.name}:\n{self.output()[-4000:]}"
            assert time.monotonic() < deadline, f"no {marker.name} after {timeout} s:\n{self.output()[-4000:]}"
            time.sleep(0.5)
        (os.killpg if group else os.kill)(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        return self.output()


def resumed_from(output: str, stage: str) -> list[str]:
    """The checkpoint each attempt of `stage` started from, in order, as the console says it (one line per
    attempt, a worker restarted by Ray Train included)."""
    return re.findall(rf"^\[{stage}\] resuming from (checkpoint-\d+)$", output, flags=re.MULTILINE)


# ---------------------------------------------------------------------------------------------------- run dir

def states(run: Path) -> dict:
    """Stage states from the manifest, which must parse at any moment."""
    return {stage: entry["state"] for stage, entry in json.loads((run / "manifest.json").read_text())["stages"].items()}


def checkpoints(run: Path, stage: str) -> list[str]:
    return sorted((p.name for p in (run / stage).glob("checkpoint-*")), key=lambda n: int(n.split("-")[1]))


def latest(run: Path, stage: str) -> str | None:
    from pipeline.rundir import latest_checkpoint

    found = latest_checkpoint(run / stage)
    return found.name if found else None


def metric_rows(run: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in row.items() if k not in PER_ATTEMPT and not k.startswith("time/")} for row in rows]


def same(a, b) -> bool:
    """Exact equality of nested state (tensors compared bit for bit)."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, np.ndarray):  # numpy's RNG state
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(map(same, a, b))
    return a == b


def differing_tensors(a: Path, b: Path) -> list[str]:
    x, y = load_file(a), load_file(b)
    assert x.keys() == y.keys()
    return [name for name in x if not same(x[name], y[name])]


def run_args(out: Path, *command: str) -> list:
    return [*command, "--set", f"output_dir={out}"]


# ---------------------------------------------------------------------------------------------------- faults

@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_killed_and_resumed_run_ends_bit_identical(tmp_path, tag):
    """One uninterrupted run, and one run of the same config through four faults, resumed each time:
    1. the driver (alone) SIGKILLed in SFT step 3;
    2. the same command resumes SFT from checkpoint-2; a worker SIGKILLs itself while writing checkpoint-4 (files
       written, not yet renamed): Ray Train restarts it and the stage completes from checkpoint-2 without a
       manual resume; then the driver's process group is SIGKILLed during the rollout of GRPO step 2;
    3. `sse-rl resume RUN_DIR` resumes GRPO from checkpoint-1; a worker SIGKILLs itself in the policy update of
       step 3: Ray Train restarts it from checkpoint-2 and the run finishes.
    Both runs must end with the same optimizer steps, bit-identical weights and optimizer state, and the same
    metrics."""
    ref_out, out = tmp_path / "reference", tmp_path / "faulted"
    Driver(run_args(ref_out, "run", CONFIG), tag, tmp_path / "reference.log").finish()
    reference = ref_out / "reliability"

    run = out / "reliability"
    faults = "sft.step@3:pause,sft.checkpoint_write@4:kill,grpo.rollout@2:pause,grpo.step@3:kill"
    command = run_args(out, "run", CONFIG)

    Driver(command, tag, tmp_path / "faulted-1.log", faults).kill_when(run / "faults" / "sft.step@3", group=False)
    # The driver alone was killed: its local Ray instance (GCS, raylet) went with it, and the workers, the paused
    # one included, exited with their raylet. The next run starts while Ray's agents may still be around.
    assert not wait_gone(tag, timeout=30, besides=RAY_AGENTS), "the killed driver left processes behind"
    assert states(run) == {"init": "done", "sft": "running"}
    assert latest(run, "sft") == "checkpoint-2"

    log = Driver(command, tag, tmp_path / "faulted-2.log", faults).kill_when(run / "faults" / "grpo.rollout@2",
                                                                              group=True)
    assert not wait_gone(tag, timeout=30), "the killed driver left processes behind"
    assert (run / "faults" / "sft.checkpoint_write@4").exists()
    # After the driver restart and after the worker restart: checkpoint-2, never the cut-off checkpoint-4.
    assert resumed_from(log, "sft") == ["checkpoint-2", "checkpoint-2"], log[-4000:]
    assert states(run) == {"init": "done", "sft": "done", "grpo": "running"}
    assert latest(run, "grpo") == "checkpoint-1"

    log = Driver(["resume", run], tag, tmp_path / "faulted-3.log", faults).finish()
    assert (run / "faults" / "grpo.step@3").exists()
    assert resumed_from(log, "grpo") == ["checkpoint-1", "checkpoint-2"], log[-4000:]
    assert resumed_from(log, "sft") == [] and "[sft] already done, skipped" in log
    # The stage's time spans both of this driver's attempts, not only the last one's.
    grpo_seconds = json.loads((run / "manifest.json").read_text())["stages"]["grpo"]["seconds"]
    assert grpo_seconds > json.loads((run / "grpo" / "result.json").read_text())["seconds"] + 1

    assert states(run) == states(reference) == {"init": "done", "sft": "done", "grpo": "done"}
    for stage, steps in (("sft", 6), ("grpo", 3)):
        result = json.loads((run / stage / "result.json").read_text())
        assert result["steps"] == json.loads((reference / stage / "result.json").read_text())["steps"] == steps
        assert checkpoints(run, stage) == checkpoints(reference, stage)
        assert not list((run / stage).glob(".partial-*")), "a partial checkpoint was left behind"
        assert not differing_tensors(run / stage / "final" / "model.safetensors",
                                     reference / stage / "final" / "model.safetensors")
        # The last checkpoint as a whole: optimizer (its per-parameter step counts included), scheduler, RNG.
        last = f"checkpoint-{steps}"
        for name in ("optimizer.pt", "scheduler.pt", "rng_state.pth"):
            assert same(torch.load(run / stage / last / name, weights_only=False),
                        torch.load(reference / stage / last / name, weights_only=False)), f"{stage} {last}/{name}"
    assert metric_rows(run) == metric_rows(reference)


def free_ports(n: int) -> list[int]:
    sockets = [socket.socket() for _ in range(n)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_ray_job_stopped_and_resubmitted_continues(tmp_path, tag):
    """`ray job submit` to a Ray head on loopback, `ray job stop` in SFT step 3, resubmit: the run continues from
    checkpoint-2 and finishes. The head is this test's own (its own temp dir and ports)."""
    config = tmp_path / "job.yaml"
    config.write_text(f"extends: {CONFIG}\nstages: [init, sft]\n")
    run = tmp_path / "reliability"
    temp = Path(tempfile.mkdtemp(prefix="ray-", dir="/tmp"))  # short: Ray's socket paths must fit in 107 bytes
    gcs, dashboard, client, agent = free_ports(4)
    # Ray's token authentication, with a token of this test's own: what anyone sharing the machine should use.
    token = uuid.uuid4().hex
    env = tagged_env(tag, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token)
    address = f"http://127.0.0.1:{dashboard}"

    def ray(*args, timeout=120):
        out = subprocess.run([BIN / "ray", *map(str, args)], cwd=REPO, env=env, capture_output=True, text=True,
                             timeout=timeout)
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        return out.stdout

    def submit(job_id):
        ray("job", "submit", "--address", address, "--submission-id", job_id, "--no-wait", "--runtime-env-json",
            json.dumps({"env_vars": {"SSE_RL_FAULTS": "sft.step@3:pause", "RAY_DEDUP_LOGS": "0"}}), "--",
            BIN / "sse-rl", "run", config, "--set", f"output_dir={tmp_path}")

    def wait_for(jobs, job_id, until, timeout=600):
        """Until the job's status is `until`, or the file `until` exists; meanwhile the job must be alive."""
        deadline = time.monotonic() + timeout
        while True:
            status = jobs.get_job_status(job_id).value
            if status == until or (isinstance(until, Path) and until.exists()):
                return jobs.get_job_logs(job_id)
            assert status in ("PENDING", "RUNNING"), f"job {job_id} is {status}:\n{jobs.get_job_logs(job_id)[-4000:]}"
            assert time.monotonic() < deadline, f"job {job_id}: no {until} after {timeout} s"
            time.sleep(1)

    try:
        ray("start", "--head", "--num-cpus=2", f"--port={gcs}", "--dashboard-host=127.0.0.1",
            f"--dashboard-port={dashboard}", f"--ray-client-server-port={client}",
            f"--dashboard-agent-listen-port={agent}", f"--temp-dir={temp}", "--disable-usage-stats")
        from ray.job_submission import JobSubmissionClient

        jobs = JobSubmissionClient(address, headers={"Authorization": f"Bearer {token}"})
        submit("first")
        marker = run / "faults" / "sft.step@3"
        wait_for(jobs, "first", marker)
        paused_worker = int(marker.read_text().split()[2])  # "pause pid N"
        ray("job", "stop", "--address", address, "first")
        wait_for(jobs, "first", "STOPPED")
        deadline = time.monotonic() + 60  # Ray reaps the stopped job's workers
        while Path(f"/proc/{paused_worker}").exists() and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not Path(f"/proc/{paused_worker}").exists(), "the stopped job's training worker is still running"
        assert states(run) == {"init": "done", "sft": "running"}
        assert latest(run, "sft") == "checkpoint-2"

        submit("second")
        logs = wait_for(jobs, "second", "SUCCEEDED")
        assert "[init] already done, skipped" in logs
        assert resumed_from(logs, "sft") == ["checkpoint-2"], logs[-4000:]
        assert states(run) == {"init": "done", "sft": "done"}
        assert json.loads((run / "sft" / "result.json").read_text())["steps"] == 6
        assert checkpoints(run, "sft") == ["checkpoint-4", "checkpoint-6"]  # tiny.yaml keeps the last two
    finally:
        # Our head only: SIGTERM lets Ray's daemons exit cleanly, SIGKILL takes whatever did not.
        kill_tagged(tag, signal.SIGTERM)
        wait_gone(tag, timeout=15)
        kill_tagged(tag)
        shutil.rmtree(temp, ignore_errors=True)


# ---------------------------------------------------------------------------------------------------- bad input
# Cases covered elsewhere (docs/reliability.md has the table): malformed dataset rows (tests/test_data.py
# test_malformed_rl_rows, test_malformed_sft_rows), configs with unknown keys or wrong types
# (tests/test_config.py test_bad_config_names_file_and_key; tests/test_pipeline.py
# test_bad_config_fails_before_any_work), prompts over the limit (tests/test_data.py test_filter_long_prompts),
# rewards that raise, return NaN or the wrong length, or whose grading hangs (tests/test_rewards.py).

# A very small SSE-H and a few SFT steps, a checkpoint after each: seconds on a CPU.
TINIER = [
    "model.config.hidden_size=32", "model.config.intermediate_size=64", "model.config.num_hidden_layers=2",
    "model.config.layer_types=[linear_attention,full_attention]", "model.config.num_attention_heads=1",
    "model.config.num_key_value_heads=1", "model.config.head_dim=32", "model.config.sse_num_heads=2",
    "model.config.sse_key_dim=16", "model.config.sse_value_dim=16", "model.config.sse_lora_rank=4",
    "data.sft.generator.num_examples=64", "sft.per_device_batch_size=4",
    "sft.max_steps=4", "sft.save_steps=1",
]


def tiny_config(out: Path, *overrides: str):
    from pipeline.config import load_config

    return load_config(CONFIG, [*TINIER, f"output_dir={out}", *overrides])


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    """The init stage's model for TINIER."""
    from pipeline.rundir import RunDir
    from pipeline.stages import init

    cfg = tiny_config(tmp_path_factory.mktemp("tiny"))
    run = RunDir(cfg.run_dir)
    run.create()
    return init.run(cfg, run)["output"]


def run_sft(cfg, model_path: str) -> dict:
    """The SFT stage as a Ray worker runs it (minus Ray): returns what it reports to the driver."""
    from pipeline.config import resolve
    from pipeline.orchestrator import execute_stage
    from pipeline.rundir import RunDir

    RunDir(cfg.run_dir).create()  # the driver's part
    execute_stage("sft", resolve(cfg), str(cfg.run_dir), model_path)
    return json.loads((cfg.run_dir / "sft" / "result.json").read_text())


@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_non_finite_loss_stops_the_stage_and_keeps_the_last_good_checkpoint(tmp_path, tiny_model, monkeypatch, bad):
    from pipeline.stages import sft

    class Diverging(sft.SSESFTTrainer):
        def compute_loss(self, *args, **kwargs):  # the loss of step 3 (global_step 2 while it runs) goes bad
            loss = super().compute_loss(*args, **kwargs)
            return loss * bad if self.state.global_step == 2 else loss

    monkeypatch.setattr(sft, "SSESFTTrainer", Diverging)
    cfg = tiny_config(tmp_path)
    result = run_sft(cfg, tiny_model)
    assert result["status"] == "failed"
    assert result["error"] == (f"NonFiniteLoss: loss is {bad} at step 3; the stage stops here and the last good "
                               "checkpoint, checkpoint-2, is kept")
    run = cfg.run_dir
    assert checkpoints(run, "sft") == ["checkpoint-1", "checkpoint-2"] and not (run / "sft" / "final").exists()
    weights = load_file(run / "sft" / "checkpoint-2" / "model.safetensors")
    assert all(torch.isfinite(t).all() for t in weights.values())


def test_disk_full_during_a_checkpoint_write(tmp_path, tiny_model, monkeypatch):
    """ENOSPC while checkpoint-3 is written (the weights are in, the optimizer state half-written): the stage
    stops naming the checkpoint and the last complete one; the partial directory is removed, never picked; once
    there is space again, a resume continues from checkpoint-2."""
    real_save = torch.save
    failed = []

    def full_disk(obj, f, *args, **kwargs):
        if str(f).endswith("checkpoint-3/optimizer.pt"):
            Path(f).write_bytes(b"\0" * 4096)  # what made it to disk before the device filled up
            failed.append(f)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(f))
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", full_disk)
    cfg = tiny_config(tmp_path)
    result = run_sft(cfg, tiny_model)
    staging = cfg.run_dir / "sft" / ".partial-checkpoint-3"
    assert result["status"] == "failed" and failed == [str(staging / "checkpoint-3" / "optimizer.pt")]
    assert result["error"] == (
        f"CheckpointWriteError: checkpoint-3 could not be written to {staging}: [Errno 28] No space left on device: "
        f"'{failed[0]}'; the partial checkpoint was removed and the last complete one, checkpoint-2, is kept")
    assert not staging.exists() and latest(cfg.run_dir, "sft") == "checkpoint-2"

    monkeypatch.setattr(torch, "save", real_save)
    result = run_sft(cfg, tiny_model)
    assert result["status"] == "done" and result["steps"] == 4
    assert result["summary"].endswith("(resumed from checkpoint-2)")


def test_killed_after_its_last_checkpoint_the_stage_resumes_to_exactly_its_steps(tmp_path, tiny_model):
    """SIGKILL in the window between the last checkpoint (checkpoint-4, at max_steps) and the stage's end: the final
    model written, the stage not yet reported done (fault point `sft.end`). The resume starts from checkpoint-4 and
    trains nothing more (the Trainer alone ran a fifth step): 4 steps, the final weights and the metrics of an
    uninterrupted run."""
    reference = tiny_config(tmp_path / "reference")
    assert run_sft(reference, tiny_model)["steps"] == 4
    cfg = tiny_config(tmp_path / "killed")
    code = ("import sys; from pipeline.config import load_config, resolve; from pipeline.orchestrator import "
            "execute_stage; from pipeline.rundir import RunDir; cfg = load_config(sys.argv[1], sys.argv[3:]); "
            "RunDir(cfg.run_dir).create(); execute_stage('sft', resolve(cfg), str(cfg.run_dir), sys.argv[2])")
    killed = subprocess.run([sys.executable, "-c", code, CONFIG, tiny_model, *TINIER,
                             f"output_dir={tmp_path / 'killed'}"], cwd=REPO, capture_output=True, text=True,
                            env=dict(os.environ, SSE_RL_FAULTS="sft.end@4:kill"), timeout=600)
    run = cfg.run_dir
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert latest(run, "sft") == "checkpoint-4" and (run / "sft" / "final").exists()
    assert not (run / "sft" / "result.json").exists()

    result = run_sft(cfg, tiny_model)
    assert result["status"] == "done" and result["steps"] == 4, result
    assert result["summary"].startswith("4 steps") and result["summary"].endswith("(resumed from checkpoint-4)")
    assert checkpoints(run, "sft") == checkpoints(reference.run_dir, "sft")
    assert not differing_tensors(run / "sft" / "final" / "model.safetensors",
                                 reference.run_dir / "sft" / "final" / "model.safetensors")
    assert metric_rows(run) == metric_rows(reference.run_dir)


# Loads a checkpoint with transformers alone and writes its logits on fixed ids; run with `python -S` and only the
# interpreter's site-packages on the path, so neither the checkout nor the installed sse-rl can be imported.
LOAD_WITHOUT_THE_PROJECT = """
import importlib.util, sys, torch
from transformers import AutoModelForCausalLM
assert all(importlib.util.find_spec(m) is None for m in ("sse_model", "pipeline")), "the project is importable"
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True, dtype=torch.float32)
assert type(model).__module__.startswith("transformers_modules."), type(model).__module__
torch.save(model(torch.arange(1, 17)[None]).logits, sys.argv[2])
"""


def test_checkpoints_load_with_transformers_alone_and_natively(tmp_path, tiny_model):
    """Every model the pipeline writes (the init model, each SFT checkpoint and the final model) carries the model's
    code and `auto_map`: copied elsewhere, it loads with `trust_remote_code=True` where sse-rl cannot be imported,
    computing what the native model computes; with sse-rl imported it loads natively."""
    import site

    from transformers import AutoModelForCausalLM

    from sse_model import SSEForCausalLM

    cfg = tiny_config(tmp_path / "run")
    assert run_sft(cfg, tiny_model)["status"] == "done"
    written = [Path(tiny_model), *(cfg.run_dir / "sft" / name for name in checkpoints(cfg.run_dir, "sft")),
               cfg.run_dir / "sft" / "final"]
    assert checkpoints(cfg.run_dir, "sft") == ["checkpoint-3", "checkpoint-4"]  # tiny.yaml keeps the last two
    for path in written:
        config = json.loads((path / "config.json").read_text())
        assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_sse.SSEForCausalLM", path
        assert (path / "modeling_sse.py").exists() and (path / "configuration_sse.py").exists(), path

    copy = tmp_path / "elsewhere" / "sse-h-tiny"
    shutil.copytree(cfg.run_dir / "sft" / "final", copy)
    logits = tmp_path / "logits.pt"
    env = {"PATH": os.environ["PATH"], "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join(site.getsitepackages())}
    out = subprocess.run([sys.executable, "-S", "-c", LOAD_WITHOUT_THE_PROJECT, copy, logits], cwd=tmp_path,
                         env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]

    native = AutoModelForCausalLM.from_pretrained(copy, dtype=torch.float32)
    assert type(native) is SSEForCausalLM
    with torch.no_grad():
        expected = native(torch.arange(1, 17)[None]).logits
    torch.testing.assert_close(torch.load(logits), expected, rtol=1e-5, atol=1e-5)


def test_checkpoint_of_another_architecture_is_refused(tmp_path):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from pipeline.rundir import RunDir
    from pipeline.stages import init

    Qwen2ForCausalLM(Qwen2Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1)).save_pretrained(tmp_path / "qwen2")
    cfg = tiny_config(tmp_path, "model.init=pretrained", f"model.path={tmp_path / 'qwen2'}")
    with pytest.raises(init.CheckpointError) as err:
        init.run(cfg, RunDir(cfg.run_dir))
    assert str(err.value) == (f"{tmp_path / 'qwen2'}: model_type 'qwen2' is not an SSE-H checkpoint (sse_hybrid); "
                              "convert it first (stage `convert`, or `sse-rl convert`)")


@pytest.mark.parametrize("edit", ["missing", "unexpected", "shape"])
def test_checkpoint_whose_tensors_do_not_match_its_config_is_refused(tmp_path, tiny_model, edit):
    """Transformers would only warn and initialise missing tensors at random: the init stage refuses them."""
    from pipeline.rundir import RunDir
    from pipeline.stages import init

    path = tmp_path / "model"
    shutil.copytree(tiny_model, path)
    tensors = load_file(path / "model.safetensors")
    names = sorted(tensors)
    if edit == "missing":
        del tensors[names[0]], tensors[names[1]]
        problem = f"2 missing: {names[0]}, {names[1]}"
    elif edit == "unexpected":
        tensors["model.layers.9.extra.weight"] = torch.zeros(2)
        problem = "1 unexpected: model.layers.9.extra.weight"
    else:
        shape = list(tensors[names[0]].shape)
        tensors[names[0]] = tensors[names[0]][..., :1].contiguous()
        problem = f"shape mismatch: {names[0]} is {shape[:-1] + [1]}, expected {shape}"
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    cfg = tiny_config(tmp_path, "model.init=pretrained", f"model.path={path}")
    with pytest.raises(init.CheckpointError) as err:
        init.run(cfg, RunDir(cfg.run_dir))
    assert str(err.value) == f"{path}: the tensors do not match its config.json: {problem}"


def test_run_directory_locked_by_a_live_driver(tmp_path):
    """A second driver on a run directory in use stops before touching it; the lock dies with its holder."""
    from pipeline.rundir import RunDir

    run = tmp_path / "reliability"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from pipeline.rundir import RunDir; run = RunDir(sys.argv[1]); "
         "run.create(); run.lock(); print('locked', flush=True); time.sleep(600)", str(run)],
        cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "locked\n"
        out = subprocess.run([BIN / "sse-rl", "run", CONFIG, "--set", f"output_dir={tmp_path}"], cwd=REPO,
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 1
        assert out.stderr.strip() == (f"sse-rl run: {run} is in use by a live driver (pid {holder.pid} on "
                                      f"{os.uname().nodename}); wait for it or stop it first")
        assert not (run / "config.yaml").exists() and not (run / "manifest.json").exists()
    finally:
        holder.kill()  # SIGKILL: no chance to unlock
        holder.wait()
    second = RunDir(run)
    second.lock()
    second.unlock()


def test_metrics_line_cut_off_by_a_kill_is_skipped(tmp_path):
    """A kill in the middle of an append leaves half a line: it is skipped, and the next line still counts."""
    from pipeline.rundir import RunDir

    run = RunDir(tmp_path)
    run.create()
    run.log_metrics("sft", 1, {"loss": 1.0})
    with open(run.metrics_path, "a") as f:
        f.write('{"stage": "sft", "step": 2, "lo')
    run.log_metrics("sft", 2, {"loss": 2.0})
    assert [(row["step"], row["loss"]) for row in run.read_metrics("sft")] == [(1, 1.0), (2, 2.0)]
    run.drop_metrics_after("sft", 1)  # what a resume from checkpoint-1 does
    assert [row["step"] for row in run.read_metrics("sft")] == [1]


# ---------------------------------------------------------------------------------------------------- failing rewards

def _always_raises(prompts, completions, **kwargs):
    raise ZeroDivisionError("division by zero")


def _fails_on_two_of_five(prompts, completions, **kwargs):
    if completions[0].startswith("bad"):
        raise ValueError("bad completion")
    return [1.0] * len(completions)


def test_a_reward_that_keeps_failing_stops_the_stage_with_a_named_error():
    """A failing reward scores 0 and is counted; one that fails on more than max_share of the completions for
    `steps` batches in a row raises RewardsFailing out of the reward call, which ends TRL's step and the stage."""
    import types

    import rewards

    rewards.register("test_always_raises")(_always_raises)
    (broken,), _ = rewards.build_rewards(["test_always_raises"], failure_limit=rewards.FailureLimit(0.5, 3))
    state = types.SimpleNamespace(global_step=0)
    for step in range(2):
        state.global_step = step
        assert broken(["p"] * 4, ["c"] * 4, trainer_state=state) == [0.0] * 4  # scored 0, counted, training goes on
    state.global_step = 2
    with pytest.raises(rewards.RewardsFailing, match=r"^reward 'test_always_raises' failed on more than 50% of the "
                       r"completions in 3 rollout batches in a row \(4/4 at step 1, 4/4 at step 2, 4/4 at step 3\); "
                       r"last failure: raised ZeroDivisionError: division by zero \(error\)\. .*grpo.reward_failure"):
        broken(["p"] * 4, ["c"] * 4, trainer_state=state)

    # At or under the share, or with a good batch in between, it never stops.
    rewards.register("test_fails_on_two_of_five")(_fails_on_two_of_five)
    (some,), _ = rewards.build_rewards(["test_fails_on_two_of_five"], failure_limit=rewards.FailureLimit(0.5, 2))
    for _ in range(5):
        assert some(["p"] * 5, ["bad", "bad", "ok", "ok", "ok"]) == [0.0, 0.0, 1.0, 1.0, 1.0]
    for batch in (["bad"] * 4, ["ok"] * 4, ["bad"] * 4, ["ok"] * 4):
        some(["p"] * 4, batch)
    (unlimited,), _ = rewards.build_rewards(["test_always_raises"])  # failure_limit None: never stops
    for _ in range(5):
        assert unlimited(["p"], ["c"]) == [0.0]


def test_the_grpo_stage_stops_on_a_failing_reward_by_default():
    """On by default (grpo.reward_failure), configurable, null turns it off."""
    from pipeline.config import load_config

    assert load_config("configs/tiny.yaml").grpo.reward_failure.max_share == 0.5
    cfg = load_config("configs/tiny.yaml", ["grpo.reward_failure={max_share: 0.9, steps: 5}"])
    assert (cfg.grpo.reward_failure.max_share, cfg.grpo.reward_failure.steps) == (0.9, 5)
    assert load_config("configs/tiny.yaml", ["grpo.reward_failure=null"]).grpo.reward_failure is None


@pytest.mark.slow
def test_a_run_whose_reward_always_raises_ends_failed(tmp_path):
    """End to end (init and GRPO on the tiny config, real Ray, TRL and vLLM): the run ends failed with a non-zero
    exit and the named error, not `done` with reward 0."""
    (tmp_path / "boom_reward.py").write_text("def boom(prompts, completions, **kwargs):\n    return 1 / 0\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(REPO), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run(
        [str(Path(sys.executable).with_name("sse-rl")), "run", "configs/tiny.yaml", "--set", f"output_dir={tmp_path}",
         "--set", "stages=[init, grpo]", "--set", "grpo.steps=4", "--set", "grpo.rewards=[{name: 'boom_reward:boom'}]",
         "--set", "grpo.reward_failure={max_share: 0.5, steps: 2}", "--set", "data.sft.generator.num_examples=200"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 1, out.stdout[-2000:] + out.stderr[-2000:]
    assert "stage grpo failed: RewardsFailing: reward 'boom' failed on more than 50% of the completions in 2 " \
           "rollout batches in a row" in out.stderr
    manifest = json.loads((tmp_path / "tiny" / "manifest.json").read_text())
    assert manifest["stages"]["grpo"]["state"] == "failed" and "RewardsFailing" in manifest["stages"]["grpo"]["error"]
