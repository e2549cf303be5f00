"""One evaluation over several engines, one process per engine, each on its own GPUs: what `sse-rl eval --engines`
and the eval stage (`resources.eval.num_workers`) launch. `EngineProcesses` is `eval.runner.evaluate`'s `launch`:
each share of the work (eval/shards.py) goes to `python -m eval.workers <plan>` with CUDA_VISIBLE_DEVICES set to
its GPUs, which builds its engine and appends its samples to its shard files; the launching process follows their
progress and raises when one failed, after the others have finished (their work is kept for the next run).

Files, under the output directory's shards/ while the run is unfinished: engine-<k>.json (the engine's plan),
engine-<k>.log (its output), engine-<k>.progress.json ({dataset: samples drawn}).
"""
import dataclasses
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from eval.engine import EvalEngineSettings, build_llm
from eval.runner import EvalFailed, Sampling, generate_share
from eval.shards import SHARDS
from tasks.files import write_atomic

REPO = Path(__file__).resolve().parents[1]


@dataclasses.dataclass(frozen=True)
class EngineSpec:
    """An engine any process can build: a checkpoint, the eval engine's settings and the engine's seed."""

    model: str
    settings: EvalEngineSettings
    seed: int = 0

    def build(self):
        return build_llm(self.model, self.settings, seed=self.seed)


def visible_devices() -> list[str]:
    """The GPUs this process may use, as CUDA_VISIBLE_DEVICES names them (Ray sets it for a task); none on CPU."""
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return [d.strip() for d in listed.split(",") if d.strip()]
    import torch

    return [str(i) for i in range(torch.cuda.device_count())]


def engines_for(devices_per_engine: int, engines: int | None = None) -> tuple[int, int]:
    """(engines, GPUs per engine): `engines`, or by default as many as the visible GPUs hold; none without GPUs."""
    visible = len(visible_devices())
    per = devices_per_engine if visible else 0
    return engines or max(1, visible // max(per, 1)), per


class EngineProcesses:
    """`launch(shares, out_dir, sampling, report)` for `evaluate`: share k in its own process, on the k-th group of
    `devices_per_engine` visible GPUs (0: no GPUs, the CPU build). `poll_s`: how often progress is read."""

    def __init__(self, spec: EngineSpec, devices_per_engine: int, poll_s: float = 10.0):
        self.spec, self.devices_per_engine, self.poll_s = spec, devices_per_engine, poll_s

    def __call__(self, shares: list[list[dict]], out: Path, sampling: Sampling, report=None) -> None:
        devices, per = visible_devices(), self.devices_per_engine
        if per and len(devices) < len(shares) * per:
            raise ValueError(f"{len(shares)} engines of {per} GPUs each need {len(shares) * per} GPUs; "
                             f"{len(devices)} are visible ({','.join(devices) or 'none'})")
        folder = Path(out) / SHARDS
        folder.mkdir(parents=True, exist_ok=True)
        procs = {}
        try:
            for k, share in enumerate(shares):
                if not share:  # fewer samples missing than engines
                    continue
                plan = folder / f"engine-{k}.json"
                plan.with_suffix(".progress.json").unlink(missing_ok=True)  # a previous run's
                write_atomic(plan, json.dumps({"model": self.spec.model, "seed": self.spec.seed, "out": str(out),
                                               "engine": k, "settings": dataclasses.asdict(self.spec.settings),
                                               "sampling": dataclasses.asdict(sampling), "share": share}))
                env = {**os.environ, "PYTHONPATH": os.pathsep.join(
                    p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}  # this code, not an installed copy
                if per:
                    env["CUDA_VISIBLE_DEVICES"] = ",".join(devices[k * per:(k + 1) * per])
                with (folder / f"engine-{k}.log").open("w") as log:
                    procs[k] = subprocess.Popen([sys.executable, "-m", "eval.workers", str(plan), str(os.getpid())],
                                                env=env, stdout=log, stderr=subprocess.STDOUT)
            while any(p.poll() is None for p in procs.values()):
                time.sleep(self.poll_s)
                self._report(folder, procs, report)
        finally:
            for p in procs.values():  # an interrupted launcher takes its engines along
                if p.poll() is None:
                    p.terminate()
                    p.wait()
        self._report(folder, procs, report)
        failed = [f"engine {k} exited with {p.returncode} (its log, {folder / f'engine-{k}.log'}, ends: "
                  f"{_tail(folder / f'engine-{k}.log')})" for k, p in procs.items() if p.returncode]
        if failed:
            raise EvalFailed(f"{'; '.join(failed)}; the other engines' samples are kept: run again to resume")

    @staticmethod
    def _report(folder: Path, procs: dict, report) -> None:
        if report is None:
            return
        drawn: dict[str, int] = {}
        for k in procs:
            path = folder / f"engine-{k}.progress.json"
            for name, count in (json.loads(path.read_text()) if path.exists() else {}).items():
                drawn[name] = drawn.get(name, 0) + count
        for name, count in drawn.items():
            report(name, count)


def _tail(path: Path, lines: int = 5) -> str:
    return " | ".join(path.read_text(errors="replace").strip().splitlines()[-lines:])


def _exit_with(parent: int) -> None:
    """An engine whose launcher died (killed, its Ray task cancelled) exits too instead of holding its GPUs."""
    def watch():
        while os.getppid() == parent:
            time.sleep(2)
        os._exit(1)

    threading.Thread(target=watch, daemon=True).start()


def main(plan_path: str, parent: str) -> None:
    _exit_with(int(parent))
    plan = json.loads(Path(plan_path).read_text())
    spec = EngineSpec(plan["model"], EvalEngineSettings(**plan["settings"]), plan["seed"])
    progress_path = Path(plan_path).with_suffix(".progress.json")
    drawn: dict[str, int] = {}

    def report(name: str, count: int) -> None:
        drawn[name] = count
        write_atomic(progress_path, json.dumps(drawn))

    generate_share(spec.build, plan["share"], Path(plan["out"]), plan["engine"], Sampling(**plan["sampling"]),
                   report)


if __name__ == "__main__":  # vLLM's spawned workers re-import the main module: keep the engine behind this guard
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    main(*sys.argv[1:])
