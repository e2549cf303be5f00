"""The whole pipeline, shortened: `sse-rl run` on the tiny config with every stage (init, sft, grpo, eval), real
Ray, real TRL trainers and real vLLM CPU rollouts through the SSE plugin (issue 6)."""
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHORT = [
    "sft.max_steps=6", "sft.save_steps=3", "sft.logging_steps=2",
    "grpo.steps=3", "grpo.save_steps=3",
    "data.sft.generator.num_examples=400", "data.grpo.generator.num_examples=200",
    "eval.n=2", "eval.limit=6",
]


# Every line `sse-rl run` prints on a normal run (pipeline/console.py); the eval table's rows start with "|".
CONSOLE = re.compile(r"run \S+ \(library output: \S+/logs/<stage>\.log\)"
                     r"|\[(init|sft|grpo|eval)\] (starting|already done, skipped|done in [\d.]+ s: .+)"
                     r"|\[sft\] step \d+/\d+  loss [\d.]+  lr [\d.e+-]+(  [\d,]+ tokens/s)?"
                     r"|\[grpo\] step \d+/\d+  reward [\d.]+ \(math_accuracy [\d.]+\)  parity \S+  rollout_kl \S+  "
                     r"clip [\d.]+  length \d+  [\d.]+ s/step"
                     r"|\|.+\||run finished: \S+/report\.md")


def sse_rl(*args, timeout=900):
    return subprocess.run([str(Path(sys.executable).with_name("sse-rl")), *args], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.slow
def test_tiny_pipeline_end_to_end(tmp_path):
    out = sse_rl("run", "configs/tiny.yaml", "--set", f"output_dir={tmp_path}", *sum([["--set", s] for s in SHORT], []))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    run = tmp_path / "tiny"

    manifest = json.loads((run / "manifest.json").read_text())
    assert [s for s, e in manifest["stages"].items() if e["state"] == "done"] == ["init", "sft", "grpo", "eval"]
    assert manifest["stages"]["grpo"]["output"] == str(run / "grpo" / "final")
    for stage, steps in (("sft", 6), ("grpo", 3)):
        assert (run / stage / f"checkpoint-{steps}" / "trainer_state.json").exists()
        assert not list((run / stage).glob(".partial-*")), "a partial checkpoint was left behind"
        assert (run / stage / "final" / "model.safetensors").exists()

    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    sft = [m for m in metrics if m["stage"] == "sft" and "loss" in m]
    grpo = [m for m in metrics if m["stage"] == "grpo" and "reward" in m]
    assert sft and all(m["loss"] > 0 for m in sft)
    assert [m["step"] for m in grpo] == [1, 2, 3]
    for m in grpo:
        assert 0.0 <= m["rewards/math_accuracy/mean"] <= 1.0
        assert m["vllm_parity"] < 0.05, "vLLM scores a fixed sequence differently from the trainer after a push"
        assert m["completions/mean_length"] > 0
        assert any(k.startswith("partition_usage/") for k in m)
        # a step's time split into its phases (pipeline/trl_seams.py, pipeline/training.update_time): each timed
        # phase lies inside TRL's step_time, so what is left for the update is positive
        phases = ("time/rollout_s", "time/scoring_s", "time/weight_push_s", "time/update_s")
        assert all(m[p] > 0 for p in phases), m
        assert m["rollout_tokens_per_s"] > 0
        # KL(vLLM || trainer) on the sampled tokens (trl_seams.rollout_kl): float32 on both sides, so tiny
        assert 0 <= m["sampling/kl_rollout_trainer"] < 1e-4, m["sampling/kl_rollout_trainer"]

    for model in ("init", "sft", "grpo"):  # the tiny config compares untrained, SFT and GRPO models
        results = json.loads((run / "eval" / model / "metrics.json").read_text())
        assert results["arith-test"]["num_problems"] == 6 and "avg@2" in results["arith-test"]
    report = (run / "report.md").read_text()
    for image in ("sft_loss.png", "grpo_reward.png", "partition_usage.png"):
        assert image in report and (run / image).stat().st_size > 1000
    assert "Evaluation of the `grpo` model" in report and "arith-test" in report
    assert "SSE state of the `grpo` model" in report and "| arith-test: layer | p0 |" in report
    entropies = [v for m in metrics if m["stage"] == "eval" for k, v in m.items() if "/state_entropy/" in k]
    assert entropies and all(0 <= h <= math.log(32) for h in entropies)  # tiny config: c = d_v = 32
    changes = {k: v for m in metrics if m["stage"] == "eval" for k, v in m.items() if "-vs-" in k}
    for pair in ("sft-vs-init", "grpo-vs-sft"):  # each model against the one before it, paired by problem
        low, change, high = (changes[f"{pair}/arith-test/avg@2_change{s}"] for s in ("_ci95_low", "", "_ci95_high"))
        assert low <= change <= high
        assert pair.replace("-vs-", " vs ") in manifest["stages"]["eval"]["summary"]

    # The console has the designed lines only; what the libraries print is in the stage logs.
    assert out.stderr == ""
    assert [line for line in out.stdout.splitlines() if not CONSOLE.fullmatch(line)] == [], out.stdout
    assert len([line for line in out.stdout.splitlines() if line.startswith("[sft] step ")]) == 3  # logging_steps 2
    assert len([line for line in out.stdout.splitlines() if line.startswith("[grpo] step ")]) == 3
    assert "| grpo | arith-test |" in out.stdout  # the eval table
    logs = {path.name: path.read_text() for path in (run / "logs").glob("*.log")}
    assert "Started a local Ray instance" in logs["driver.log"]
    assert "(RayTrainWorker pid=" in logs["sft.log"] and "'loss': " in logs["sft.log"]  # Ray Train, transformers
    assert "Disassembly of" not in "".join(logs.values())  # Ray Train's print patch echoed dill's captured output
    assert "Failed to query Ray Train Controller" not in "".join(logs.values())  # once a second without dashboard
    for stage in ("grpo", "eval"):
        assert "Loading safetensors checkpoint shards" in logs[f"{stage}.log"]  # vLLM's engine start
    assert re.search(r"rollout engine: vLLM \S+, V[12] model runner", logs["grpo.log"])

    again = sse_rl("run", "configs/tiny.yaml", "--set", f"output_dir={tmp_path}",
                   *sum([["--set", s] for s in SHORT], []))
    assert again.returncode == 0 and again.stdout.count("already done, skipped") == 4, again.stdout[-2000:]


@pytest.mark.slow
def test_sft_and_grpo_on_two_ray_train_workers(tmp_path):
    """Data-parallel training through Ray Train: two TorchTrainer workers (one CPU each, gloo) run one TRL trainer
    between them, and in GRPO each rank samples its share of the rollouts from its own colocated vLLM engine, and
    of the periodic eval. Checkpoints hold both ranks' RNG states (HF's Trainer writes one per process only when
    there are several)."""
    two = ["resources.sft.num_workers=2", "resources.sft.num_cpus=1", "resources.sft.num_threads=1",
           "resources.grpo.num_workers=2", "resources.grpo.num_cpus=1", "grpo.per_device_batch_size=32",
           "grpo.eval_every=3", "eval.n=2", "eval.limit=4"]
    out = sse_rl("run", "configs/tiny.yaml", "--set", f"output_dir={tmp_path}", "--set", "stages=[init,sft,grpo]",
                 *sum([["--set", s] for s in [*(s for s in SHORT if not s.startswith("eval.")), *two]], []))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    run = tmp_path / "tiny"
    for checkpoint in (run / "sft" / "checkpoint-6", run / "grpo" / "checkpoint-3"):
        assert sorted(p.name for p in checkpoint.glob("rng_state*")) == ["rng_state_0.pth", "rng_state_1.pth"]
    grpo = [m for m in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
            if m["stage"] == "grpo" and "reward" in m]
    assert [m["step"] for m in grpo] == [1, 2, 3]
    assert all(m["vllm_parity"] < 0.05 and m["sampling/sampling_logp_difference/max"] < 0.05 for m in grpo)
    # rank 0's wait for the other rank's rollout is timed apart from its scoring and left out of the update
    assert all(m["time/rank_wait_s"] >= 0 and m["time/scoring_s"] > 0 and m["time/update_s"] > 0 for m in grpo), grpo
    # The periodic eval at step 3, drawn by both ranks' engines and merged by rank 0.
    metrics = map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
    evals = [m for m in metrics if "eval/arith-test/avg@2" in m]
    assert [(m["step"], m["eval/arith-test/skipped_problems"]) for m in evals] == [(3, 0)]
    assert len((run / "grpo" / "eval-step-3" / "arith-test.samples.jsonl").read_text().splitlines()) == 8


CLEANER_CHECK = """
import logging, ray
from pipeline.config import load_config
from pipeline.orchestrator import CLEANER_LOGGER, start_ray

def passes(message):
    return bool(logging.getLogger(CLEANER_LOGGER).filter(
        logging.LogRecord(CLEANER_LOGGER, logging.WARNING, "", 0, message, None, None)))

start_ray(load_config("configs/tiny.yaml"))
spam = "Failed to query Ray Train Controller actor state. State API may be temporarily unavailable."
print(ray.get(ray.remote(num_cpus=0)(lambda: [passes(spam), passes("Cleaning up placement group")]).remote()))
ray.shutdown()
"""


@pytest.mark.slow
def test_ray_workers_drop_only_the_placement_group_cleaners_state_api_warning():
    """Ray Train's PlacementGroupCleaner polls the State API once a second, which fails without the dashboard that
    a local instance leaves out: every Ray worker process filters that one warning, and no other."""
    out = subprocess.run([sys.executable, "-c", CLEANER_CHECK], cwd=REPO, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "[False, True]", out.stdout[-2000:]


def test_run_refuses_a_changed_config_for_an_existing_run(tmp_path):
    first = sse_rl("run", "configs/tiny.yaml", "--set", f"output_dir={tmp_path}", "--set", "stages=[init]",
                   "--set", "data.sft.generator.num_examples=50")
    assert first.returncode == 0, first.stderr[-2000:]
    second = sse_rl("run", "configs/tiny.yaml", "--set", f"output_dir={tmp_path}", "--set", "stages=[init]",
                    "--set", "data.sft.generator.num_examples=60")
    assert second.returncode == 1
    assert "started with another config (differs at data.sft.generator.num_examples)" in second.stderr


def test_bad_config_fails_before_any_work(tmp_path):
    out = sse_rl("run", "configs/tiny.yaml", "--set", f"output_dir={tmp_path}", "--set", "sft.learning_rat=1")
    assert out.returncode == 1 and "sft.learning_rat" in out.stderr
    assert not (tmp_path / "tiny").exists()


# ---------------------------------------------------------------------------------------------------- before any work

def test_missing_grpo_data_fails_at_validation_not_after_sft(tmp_path):
    (tmp_path / "grpo.jsonl.gz").write_bytes(b"")
    out = sse_rl("run", "configs/tiny.yaml", "--set", f"output_dir={tmp_path}",
                 "--set", f"data.grpo.source={tmp_path / 'grpo.jsnol.gz'}", timeout=120)
    assert out.returncode == 1, out.stdout + out.stderr
    assert (f"sse-rl run: configs/tiny.yaml: data.grpo: {tmp_path / 'grpo.jsnol.gz'}: no such file (did you mean "
            "'grpo.jsonl.gz'?)") in out.stderr
    assert not (tmp_path / "tiny").exists()  # no stage started, no run directory


@pytest.mark.parametrize("reward,key,message", [
    ("{name: math_acuracy}", "grpo.rewards[0].name", "unknown reward 'math_acuracy' (did you mean 'math_accuracy'?)"),
    ("{name: 'rewards.accuracy:math_acurracy'}", "grpo.rewards[0].name",
     "module 'rewards.accuracy' has no function 'math_acurracy' (did you mean 'math_accuracy'?)"),
    ("{name: 'rewards.nope:f'}", "grpo.rewards[0].name", "cannot import module 'rewards.nope'"),
    ("{name: math_accuracy, kwargs: {timout: 1}}", "grpo.rewards[0].kwargs",
     "unknown option(s) timout (did you mean 'timeout'?); options: timeout"),
])
def test_bad_reward_fails_at_validation(tmp_path, reward, key, message):
    from pipeline.config import ConfigError, load_config
    from pipeline.preflight import preflight

    cfg = load_config("configs/tiny.yaml", [f"grpo.rewards=[{reward}]"])
    with pytest.raises(ConfigError) as e:
        preflight(cfg, "configs/tiny.yaml")
    assert str(e.value).startswith(f"configs/tiny.yaml: {key}: ") and message in str(e.value)


R1_TEMPLATE = (  # DeepSeek-R1-distill's: an assistant turn keeps only the text after </think>
    "{% for m in messages %}{% if m['role'] == 'user' %}<|im_start|>user\n{{ m['content'] }}<|im_end|>\n"
    "{% elif m['role'] == 'assistant' %}{% set c = m['content'] %}{% if '</think>' in c %}"
    "{% set c = c.split('</think>')[-1] %}{% endif %}<|im_start|>assistant\n{{ c }}<|im_end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.mark.parametrize("template", ["project", "r1"])
def test_a_chat_template_that_drops_the_reasoning_is_refused_before_sft(tmp_path, template):
    from pipeline.config import ConfigError, load_config
    from pipeline.preflight import preflight
    from tasks.loaders import load_sft_dataset
    from tasks.sources import DataSource
    from tasks.tokenizer import conversation_texts, train_tokenizer

    tokenizer = train_tokenizer(conversation_texts(load_sft_dataset(DataSource(limit=50))), vocab_size=300)
    if template == "r1":
        tokenizer.chat_template = R1_TEMPLATE
    tokenizer.save_pretrained(tmp_path / "tok")
    cfg = load_config("configs/tiny.yaml", ["model.tokenizer.train=false", f"model.tokenizer.path={tmp_path / 'tok'}",
                                            "stages=[init, sft]"])
    if template == "project":
        preflight(cfg, "configs/tiny.yaml")
        return
    with pytest.raises(ConfigError, match=r"^configs/tiny.yaml: model.tokenizer.path: the chat template of \S+ drops "
                                          r"the reasoning of an assistant turn .*SFT trains on the whole assistant "
                                          r"turn, reasoning included"):
        preflight(cfg, "configs/tiny.yaml")
    preflight(cfg, "configs/tiny.yaml", done={"init": str(tmp_path / "init"), "sft": None})  # SFT finished: not asked


# ---------------------------------------------------------------------------------------------------- resume --set

def _failed_run(tmp_path):
    """A run directory whose init finished and whose sft failed, with a checkpoint, as a crashed run leaves it."""
    from pipeline.config import load_config
    from pipeline.orchestrator import prepare_run_dir

    cfg = load_config("configs/tiny.yaml", [f"output_dir={tmp_path}"])
    run = prepare_run_dir(cfg, cfg.run_dir)
    run.unlock()
    run.set_stage("init", "done", output=str(run.stage_dir("init") / "model"))
    run.set_stage("sft", "failed", error="RuntimeError: boom")
    (run.stage_dir("sft") / "checkpoint-2").mkdir(parents=True)
    return run


def test_resume_with_set_changes_an_unfinished_stage_and_records_it(tmp_path):
    from pipeline.config import load_config
    from pipeline.orchestrator import prepare_run_dir

    run = _failed_run(tmp_path)
    cfg = load_config(run.config_path, ["sft.learning_rate=1e-4", "grpo.steps=7"])
    prepare_run_dir(cfg, run.path, amend=True).unlock()
    assert load_config(run.config_path) == cfg  # the run continues with the corrected config
    manifest = run.manifest()
    (change,) = manifest["config_changes"]
    assert change["changes"] == {"grpo.steps": {"from": 40, "to": 7}, "sft.learning_rate": {"from": 1.5e-3, "to": 1e-4}}
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d", change["time"])
    assert manifest["stages"]["init"]["state"] == "done" and (run.stage_dir("sft") / "checkpoint-2").is_dir()


def test_resume_with_set_refuses_a_key_of_a_finished_stage(tmp_path):
    run = _failed_run(tmp_path)
    before = run.config_path.read_text()
    out = sse_rl("resume", str(run.path), "--set", "model.tokenizer.vocab_size=300", "--set", "sft.max_steps=3",
                 timeout=120)
    assert out.returncode == 1
    assert "cannot change model.tokenizer.vocab_size belongs to stage init, which is finished" in out.stderr
    assert "sft.max_steps" not in out.stderr  # sft is not finished: that change alone would be accepted
    assert run.config_path.read_text() == before and "config_changes" not in run.manifest()
    assert run.manifest()["stages"]["init"]["state"] == "done" and (run.stage_dir("sft") / "checkpoint-2").is_dir()


def test_resume_with_set_validates_the_corrected_config_before_anything_runs(tmp_path):
    run = _failed_run(tmp_path)
    out = sse_rl("resume", str(run.path), "--set", f"data.grpo.source={tmp_path / 'missing.jsonl'}", timeout=120)
    assert out.returncode == 1
    assert f"{run.config_path}: data.grpo: {tmp_path / 'missing.jsonl'}: no such file" in out.stderr
    assert "config_changes" not in run.manifest()


def test_unreachable_ray_address_is_a_named_error_before_any_stage(tmp_path):
    """ray.init would retry a GCS that does not answer for minutes, then end in a traceback: the driver tries the
    address first and stops naming it, what it tried and what to do, before any stage."""
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = sse_rl("run", "configs/tiny.yaml", "--set", f"output_dir={tmp_path}", "--set",
                 f"ray.address=127.0.0.1:{port}", timeout=120)
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr[-3000:]
    message = out.stderr.strip()
    assert message.startswith(f"sse-rl run: ray.address '127.0.0.1:{port}': no Ray cluster answers there (tried a "
                              f"TCP connection to 127.0.0.1:{port} for up to 10 s: "), message
    assert "ray start --head" in message and "leave ray.address unset" in message
    assert not (tmp_path / "tiny" / "manifest.json").exists()  # no stage started


def test_ray_runtime_env_reaches_ray_init(monkeypatch):
    """`ray.runtime_env` (a reward module shipped to a cluster's workers, their environment variables) is what
    ray.init gets, for a cluster and for the local instance (beside the pipeline's own setup hook)."""
    import ray

    from pipeline import orchestrator
    from pipeline.config import load_config

    calls = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kwargs: calls.append(kwargs))
    monkeypatch.setattr(orchestrator, "check_reachable", lambda address, source: None)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    env = ["ray.runtime_env.py_modules=[my_rewards]", "ray.runtime_env.env_vars={HF_HUB_OFFLINE: '1'}"]
    shipped = {"py_modules": ["my_rewards"], "env_vars": {"HF_HUB_OFFLINE": "1"}}
    orchestrator.start_ray(load_config(REPO / "configs" / "tiny.yaml", env))
    assert calls[-1]["runtime_env"] == {**shipped,
                                        "worker_process_setup_hook": orchestrator.quiet_placement_group_cleaner}
    orchestrator.start_ray(load_config(REPO / "configs" / "tiny.yaml", [*env, "ray.address=head:6379"]))
    assert calls[-1] == {"address": "head:6379", "log_to_driver": True, "runtime_env": shipped}


@pytest.mark.slow
def test_grpo_with_partition_replay_logs_routing_health(tmp_path):
    """grpo.partition_replay and grpo.route_flip_rate on: the rollout engine records routes, the trainer replays
    them, and every step logs the flip rate and, per SSE layer, the usage entropy and modal set share, which the
    report plots."""
    out = sse_rl("run", "configs/tiny.yaml", "--set", f"output_dir={tmp_path}", "--set", "stages=[init,grpo]",
                 "--set", "grpo.partition_replay=true", "--set", "grpo.route_flip_rate=true",
                 *sum([["--set", s] for s in SHORT if s.startswith(("grpo.", "data.grpo"))], []))
    assert out.returncode == 0, out.stderr[-3000:]
    run = tmp_path / "tiny"
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    grpo = [m for m in metrics if m["stage"] == "grpo" and "reward" in m]
    assert [m["step"] for m in grpo] == [1, 2, 3]
    for m in grpo:
        assert 0.0 <= m["routing/flip_rate"] <= 1.0
        assert 0.0 < m["routing/modal_set_share/0"] <= 1.0 and m["routing/usage_entropy/0"] >= 0.0
        # replayed routes: the trainer scores the sampled tokens as the engine does
        assert 0 <= m["sampling/kl_rollout_trainer"] < 1e-4, m["sampling/kl_rollout_trainer"]
    report = (run / "report.md").read_text()
    for image in ("grpo_routing.png", "grpo_route_flips.png"):
        assert image in report and (run / image).stat().st_size > 1000
