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

from pipeline.config import STAGES, Config, config_from_dict, resolve, save_config
from pipeline.console import Console, output_to
from pipeline.rundir import RunDir
from tasks.files import write_atomic

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
    an in-process vLLM engine stalls every op: a step then takes longer, and erratically so, than on fewer
    threads (the per-step times in a tiny run's metrics.jsonl show it). It must happen before an in-process vLLM
    engine starts: vLLM's CPU worker then freezes the count."""
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
    without: the full dashboard would add to every start and run ten more processes beside a small machine's
    stages. Each poll then fails with "Failed to query Ray Train Controller actor state" (a line a second in the
    stage logs). The cleaner is moot here anyway: the local instance shares the driver's fate, placement groups
    included. Only that message is filtered, in that logger; anything else the cleaner says still reaches the
    logs."""
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
        # The eval stage's workers are engine processes of its one task (eval/workers.py): it holds them all.
        task = ray.remote(num_cpus=res.num_cpus * res.num_workers, num_gpus=gpus_per_worker(res) * res.num_workers,
                          max_retries=cfg.ray.max_failures)
        ray.get(task(execute_stage).remote(**job))
    if not result_file.exists():
        raise StageFailed(f"stage {stage} ended without a result ({result_file} missing)")
    # The worker's own `seconds` covers its attempt only; after Ray Train restarted a worker group the stage took
    # longer (every attempt, engine starts included), and that is what the manifest and the console report.
    return {**json.loads(result_file.read_text()), "seconds": round(time.time() - started, 1)}


def gpus_per_worker(res) -> float:
    """`num_gpus` with `use_gpu` (1 when it is 0), else none (the config refuses num_gpus without use_gpu)."""
    return (res.num_gpus or 1) if res.use_gpu else 0


def prepare_run_dir(cfg: Config, run_path: Path, amend: bool = False) -> RunDir:
    """Create the run directory, or check that an existing one was made by the same config (a resume). With
    `amend` (`sse-rl resume --set`), keys of stages not finished yet may differ: the manifest records the change and
    the run's config.yaml becomes `cfg`."""
    run_dir = RunDir(run_path)
    run_dir.create()
    run_dir.lock()
    try:
        changes = config_changes(cfg, run_dir, amend)
        if changes:
            run_dir.record_config_change(changes)
        if changes or not run_dir.config_path.exists():
            save_config(cfg, run_dir.config_path)  # written atomically: a resume reads it
    except BaseException:
        run_dir.unlock()
        raise
    return run_dir


def config_changes(cfg: Config, run_dir: RunDir, amend: bool) -> dict[str, tuple]:
    """{dotted key: (old value, new value)} where `cfg` differs from the run's saved config; raises StageFailed for
    any change without `amend`, and for a change to a finished stage's key with it."""
    if not run_dir.config_path.exists():
        return {}
    from pipeline.config import load_config

    changes = dict(sorted(_changes(resolve(load_config(run_dir.config_path)), resolve(cfg))))
    if changes and not amend:
        raise StageFailed(f"{run_dir.path} was started with another config (differs at {', '.join(changes)}); use "
                          f"`sse-rl resume {run_dir.path}` to continue it (`--set KEY=VALUE` changes a stage not "
                          "finished yet), or another name for a new run")
    _refuse_changes_to_finished_stages(changes, run_dir)
    return changes


def _changes(a, b, prefix=""):
    """(dotted key, (value in a, value in b)) where two resolved configs differ; lists compare whole."""
    if isinstance(a, dict) and isinstance(b, dict):
        for key in set(a) | set(b):
            yield from _changes(a.get(key), b.get(key), f"{prefix}{key}.")
    elif a != b:
        yield prefix.rstrip("."), (a, b)


def key_stages(key: str) -> tuple[str, ...]:
    """The stages whose work a config key shapes: `sft.*`, `data.sft.*`, `resources.sft.*` belong to sft (the SFT
    data to init too: a trained tokenizer is trained on it); `ray.*` to none; `model.*` and the top-level keys to
    every stage, since every later stage starts from what they made."""
    head, _, rest = key.partition(".")
    section = rest.split(".")[0].split("[")[0]
    if head == "ray":
        return ()
    if head in ("convert", "sft", "grpo", "eval"):
        return (head,)
    if head == "resources":
        return (section,)
    if head == "data":
        return ("init", "sft") if section == "sft" else (section,)
    return STAGES


def _refuse_changes_to_finished_stages(changes: dict, run_dir: RunDir) -> None:
    finished = run_dir.finished()
    problems = []
    for key, (_old, new) in changes.items():
        if key == "stages":  # more stages may follow; a finished one stays
            dropped = [s for s in finished if s not in (new or [])]
            problems += [f"stages: drops {s}, which is finished" for s in dropped]
            continue
        problems += [f"{key} belongs to stage {s}, which is finished" for s in key_stages(key) if s in finished]
    if problems:
        raise StageFailed(f"{run_dir.path}: cannot change {'; '.join(problems)} ({run_dir.manifest_path}). A "
                          "finished stage is never redone: its output is what the later stages were built on. "
                          "Change keys of stages not finished yet, or start a new run (another name)")


def run_pipeline(cfg: Config, run_path: Path | None = None, console: Console | None = None,
                 amend: bool = False) -> RunDir:
    """Run the config's stages. The console gets the lines of pipeline/console.py; what the libraries print goes
    to the run's logs/: `<stage>.log` while a stage runs, `driver.log` before, between and after. `amend`: see
    `prepare_run_dir`."""
    console = console or Console.of_stdout()
    run_dir = prepare_run_dir(cfg, Path(run_path or cfg.run_dir), amend)
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
