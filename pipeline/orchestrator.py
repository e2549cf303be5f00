"""The driver of `sse-rl run` / `sse-rl resume`: owns the run directory and runs each stage as Ray work.

Training stages (sft, grpo) run through Ray Train (`TorchTrainer`, one TRL trainer per worker), whose failure
config restarts a stage whose worker died; the restarted stage continues from its last complete checkpoint.
The other stages run as Ray tasks with declared resources. A stage that raises (bad data, NaN loss, a weight-sync
drift) is not retried: it reports the error, the manifest marks it failed, and the last good checkpoint stays.
"""
import dataclasses
import json
import os
import re
import socket
import time
import traceback
from pathlib import Path

from pipeline.config import Config, config_from_dict, resolve, save_config
from pipeline.console import Console, output_to
from pipeline.rundir import RunDir, write_atomic

TRAINING_STAGES = ("sft", "grpo")
MODEL_STAGES = ("init", "convert", "sft", "grpo")  # stages whose output is the next stage's model


class StageFailed(RuntimeError):
    pass


def stage_function(stage: str):
    import importlib

    module = {"eval": "evaluate"}.get(stage, stage)
    return importlib.import_module(f"pipeline.stages.{module}").run


def execute_stage(stage: str, config: dict, run_path: str, model_path: str | None, write_result: bool = True):
    """Runs on a Ray worker. The result goes to `<stage>/result.json` for the driver; an exception becomes a
    failed result (returned normally, so Ray does not retry what would fail the same way again)."""
    cfg, run_dir = config_from_dict(config, source=f"{run_path}/config.yaml"), RunDir(run_path)
    run_dir.stage_dir(stage).mkdir(parents=True, exist_ok=True)
    limit_cpu_threads(getattr(cfg.resources, stage))
    start = time.time()
    try:
        result = {"status": "done", **stage_function(stage)(cfg, run_dir, model_path)}
    except Exception as err:  # reported to the driver with the traceback in the stage log
        (run_dir.logs_dir / f"{stage}-error.log").write_text(traceback.format_exc())
        result = {"status": "failed", "error": f"{type(err).__name__}: {err}"}
    result["seconds"] = round(time.time() - start, 1)
    if write_result:
        write_atomic(run_dir.stage_dir(stage) / "result.json", json.dumps(result, indent=1, default=str))


def limit_cpu_threads(res) -> None:
    """Without a GPU, compute with `num_threads`, by default one thread fewer than the stage's CPUs (at least
    one). OpenMP threads spin-wait for each other, so one that shares its core with Ray's daemons, the driver or
    an in-process vLLM engine stalls every op (measured on 2 cores: a training step of the tiny model took a
    steady 1.3 s on one thread and 1.7 to 9.6 s on two). It must happen before an in-process vLLM engine starts:
    vLLM's CPU worker then freezes the count."""
    import torch

    if not torch.cuda.is_available():
        torch.set_num_threads(res.num_threads or max(1, int(res.num_cpus) - 1))


def _train_worker(loop_config: dict):
    import ray.train

    execute_stage(**loop_config, write_result=ray.train.get_context().get_world_rank() == 0)


def start_ray(cfg: Config) -> bool:
    """Start a local Ray instance or join `ray.address`; False when this process was connected already."""
    import ray

    if ray.is_initialized():
        return False
    # Ray Train replaces `print` in its workers with a logger that also echoes every line, even one printed into
    # a captured stream: `datasets` fingerprints TRL's dataset map functions with dill, which reads globals from a
    # `dis.dis` disassembly printed into a captured stdout, and each SFT start printed ~640 lines of bytecode.
    # Ray Train passes this variable from the driver to its workers.
    os.environ.setdefault("RAY_TRAIN_ENABLE_PRINT_PATCH", "0")
    address = cfg.ray.address or os.environ.get("RAY_ADDRESS")  # RAY_ADDRESS is set under `ray job submit`
    runtime_env = ray_runtime_env(cfg)
    if address:
        source = "ray.address" if cfg.ray.address else "RAY_ADDRESS"
        check_reachable(address, source)
        try:
            ray.init(address=address, log_to_driver=True, runtime_env=runtime_env or None)
        except ConnectionError as err:  # "auto" with no cluster on this machine
            raise RayUnreachable(f"{source} {address!r}: {err}; {WHAT_TO_DO}") from None
    else:
        # "local": a fresh instance owned by this driver. Left to its default, ray.init() joins whatever cluster a
        # `ray start` on this machine last advertised (/tmp/ray/ray_current_cluster), someone else's included.
        # Its GCS and raylet share the driver's fate, so a SIGKILLed driver takes the instance along (the workers
        # exit with their raylet) and the next run starts a fresh one.
        ray.init(address="local", num_cpus=cfg.ray.num_cpus, num_gpus=cfg.ray.num_gpus, include_dashboard=False,
                 log_to_driver=True,
                 runtime_env={**runtime_env, "worker_process_setup_hook": quiet_placement_group_cleaner})
    return True


def ray_runtime_env(cfg: Config) -> dict:
    """`ray.runtime_env` as Ray takes it: the keys the config sets."""
    env = cfg.ray.runtime_env
    return {} if env is None else {k: v for k, v in dataclasses.asdict(env).items() if v is not None}


class RayUnreachable(RuntimeError):
    """`ray.address` (or RAY_ADDRESS) names a cluster that does not answer; raised before any stage."""


WHAT_TO_DO = ("start the cluster's head (`ray start --head`) or check it (`ray status` there), check that this machine "
              "reaches its GCS port (6379 unless `ray start --port` said otherwise), or leave ray.address unset to run "
              "on a local Ray instance")


def check_reachable(address: str, source: str, timeout: float = 10.0) -> None:
    """Fail fast, naming the address, where ray.init would retry an unreachable GCS for minutes: a TCP connection
    to a `host:port` or `ray://host:port` address. Other forms ("auto", "local") are left to ray.init."""
    found = re.fullmatch(r"(?:ray://)?([^:/]+):(\d+)", address)
    if not found:
        return
    host, port = found.group(1), int(found.group(2))
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError as err:
        raise RayUnreachable(f"{source} {address!r}: no Ray cluster answers there (tried a TCP connection to "
                             f"{host}:{port} for up to {timeout:g} s: {err}); {WHAT_TO_DO}") from None


CLEANER_LOGGER = "ray.train.v2._internal.execution.controller.placement_group_cleaner"


def quiet_placement_group_cleaner() -> None:
    """Ray's `worker_process_setup_hook` for a local instance: drops one warning of Ray Train's
    PlacementGroupCleaner. That detached actor (added by every trainer, with no option to leave it out) asks the
    State API once a second whether the train controller is alive, so that it can remove the controller's placement
    group should the controller die. The State API is served by the dashboard, which a local instance starts
    without: the full dashboard costs 4 s more at start and ten more processes (~1 GiB) on a 2-core machine. Each
    poll then fails with "Failed to query Ray Train Controller actor state" (~725 lines per tiny run in the stage
    logs). The cleaner is moot here anyway: the local instance shares the driver's fate, placement groups included.
    Only that message is filtered, in that logger; anything else the cleaner says still reaches the logs."""
    import logging

    logging.getLogger(CLEANER_LOGGER).addFilter(
        lambda record: not record.getMessage().startswith("Failed to query Ray Train Controller actor state"))


def launch(stage: str, cfg: Config, run_dir: RunDir, model_path: str | None) -> dict:
    """Run one stage on the cluster and return its result."""
    import ray

    res = getattr(cfg.resources, stage)
    result_file = run_dir.stage_dir(stage) / "result.json"
    result_file.unlink(missing_ok=True)
    started = time.time()
    job = dict(stage=stage, config=resolve(cfg), run_path=str(run_dir.path.resolve()), model_path=model_path)
    if stage in TRAINING_STAGES:
        from ray.train import FailureConfig, RunConfig, ScalingConfig
        from ray.train.torch import TorchTrainer

        worker = {"CPU": res.num_cpus, **({"GPU": gpus_per_worker(res)} if res.use_gpu else {})}
        trainer = TorchTrainer(
            _train_worker, train_loop_config=job,
            scaling_config=ScalingConfig(num_workers=res.num_workers, use_gpu=res.use_gpu,
                                         resources_per_worker=worker),
            run_config=RunConfig(name=stage, storage_path=str((run_dir.path / "ray").resolve()),
                                 failure_config=FailureConfig(max_failures=cfg.ray.max_failures)))
        trainer.fit()
    else:
        task = ray.remote(num_cpus=res.num_cpus, num_gpus=gpus_per_worker(res), max_retries=cfg.ray.max_failures)
        ray.get(task(execute_stage).remote(**job))
    if not result_file.exists():
        raise StageFailed(f"stage {stage} ended without a result ({result_file} missing)")
    # The worker's own `seconds` covers its attempt only; after Ray Train restarted a worker group the stage took
    # longer (every attempt, engine starts included), and that is what the manifest and the console report.
    return {**json.loads(result_file.read_text()), "seconds": round(time.time() - started, 1)}


def gpus_per_worker(res) -> float:
    """`num_gpus` with `use_gpu` (1 when it is 0), else none (the config refuses num_gpus without use_gpu)."""
    return (res.num_gpus or 1) if res.use_gpu else 0


def prepare_run_dir(cfg: Config, run_path: Path) -> RunDir:
    """Create the run directory, or check that an existing one was made by the same config (a resume)."""
    run_dir = RunDir(run_path)
    if run_dir.config_path.exists():
        from pipeline.config import load_config

        previous = resolve(load_config(run_dir.config_path))
        current = resolve(cfg)
        changed = sorted(_changed_keys(previous, current))
        if changed:
            raise StageFailed(f"{run_path} was started with another config (differs at {', '.join(changed)}); "
                              f"use `sse-rl resume {run_path}` to continue it, or another name for a new run")
    run_dir.create()
    run_dir.lock()
    if not run_dir.config_path.exists():
        staging = run_dir.path / ".config.yaml.partial"  # a resume reads it: never half-written
        save_config(cfg, staging)
        os.replace(staging, run_dir.config_path)
    return run_dir


def _changed_keys(a, b, prefix=""):
    if isinstance(a, dict) and isinstance(b, dict):
        for key in set(a) | set(b):
            yield from _changed_keys(a.get(key), b.get(key), f"{prefix}{key}.")
    elif a != b:
        yield prefix.rstrip(".")


def run_pipeline(cfg: Config, run_path: Path | None = None, console: Console | None = None) -> RunDir:
    """Run the config's stages. The console gets the lines of pipeline/console.py; what the libraries print goes
    to the run's logs/: `<stage>.log` while a stage runs, `driver.log` before, between and after."""
    console = console or Console.of_stdout()
    run_dir = prepare_run_dir(cfg, Path(run_path or cfg.run_dir))
    console.line(f"run {run_dir.path} (library output: {run_dir.logs_dir}/<stage>.log)")
    driver_log = run_dir.logs_dir / "driver.log"
    try:
        with output_to(driver_log), console.follow(driver_log):
            _run_stages(cfg, run_dir, console)
    finally:
        run_dir.unlock()
    console.line(f"run finished: {run_dir.path / 'report.md'}")
    return run_dir


def _run_stages(cfg: Config, run_dir: RunDir, console: Console) -> None:
    import ray

    from pipeline.report import write_report

    connected = start_ray(cfg)
    try:
        model_path = None
        for stage in cfg.stages:
            state = run_dir.stage_state(stage)
            if state == "done":
                model_path = run_dir.stage_output(stage) or model_path
                console.line(f"[{stage}] already done, skipped")
                continue
            console.line(f"[{stage}] {'resuming' if state in ('running', 'failed') else 'starting'}")
            run_dir.set_stage(stage, "running")
            log = run_dir.logs_dir / f"{stage}.log"
            with output_to(log), console.follow(log, run_dir, stage):
                result = launch(stage, cfg, run_dir, model_path)
            if result["status"] != "done":
                run_dir.set_stage(stage, "failed", error=result.get("error"))
                write_report(run_dir)
                raise StageFailed(f"stage {stage} failed: {result.get('error')} (traceback: "
                                  f"{run_dir.logs_dir / f'{stage}-error.log'}; its output: {log})")
            run_dir.set_stage(stage, "done", output=result.get("output"), summary=result.get("summary"),
                              seconds=result.get("seconds"))
            if stage in MODEL_STAGES:
                model_path = result["output"]
            console.line(f"[{stage}] done in {result.get('seconds')} s: {result.get('summary')}")
            if result.get("table"):
                console.line(result["table"])
            write_report(run_dir)
    finally:
        if connected:  # while the output still goes to the driver log: at exit, Ray would print to the console
            ray.shutdown()
