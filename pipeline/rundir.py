"""The run directory `runs/<name>/`: resolved config, manifest of stage status, checkpoints, metrics, logs, report.

Every file that a reader may see half-written is replaced whole (tasks.files.write_atomic), so a kill at any
moment leaves either the old or the new version, never a mix.
"""
import fcntl
import json
import os
import re
import time
from pathlib import Path

from tasks.files import write_atomic

STAGE_STATES = ("pending", "running", "done", "failed")
CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")


def latest_checkpoint(folder: Path) -> Path | None:
    """The highest `checkpoint-<step>` in `folder`. Checkpoints are renamed into place only once complete, so a
    directory cut off mid-write never has this name."""
    if not folder.is_dir():
        return None
    steps = [(int(m.group(1)), p) for p in folder.iterdir() if p.is_dir() and (m := CHECKPOINT.match(p.name))]
    return max(steps)[1] if steps else None


class RunLocked(RuntimeError):
    pass


class RunDir:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.manifest_path = self.path / "manifest.json"
        self._lock_file = None

    # --- layout -------------------------------------------------------------------------------------------
    @property
    def config_path(self) -> Path:
        return self.path / "config.yaml"

    @property
    def metrics_path(self) -> Path:
        return self.path / "metrics.jsonl"

    @property
    def logs_dir(self) -> Path:
        return self.path / "logs"

    def stage_dir(self, stage: str) -> Path:
        return self.path / stage

    # --- lifecycle ----------------------------------------------------------------------------------------
    def create(self) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        self.logs_dir.mkdir(exist_ok=True)

    def lock(self) -> None:
        """One live driver per run directory. The lock is an flock, so it dies with its process (SIGKILL too)."""
        self._lock_file = open(self.path / ".driver.lock", "a+")
        try:
            fcntl.flock(self._lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock_file.seek(0)
            holder = self._lock_file.read().strip() or "another process"
            self._lock_file.close()
            self._lock_file = None
            message = f"{self.path} is in use by a live driver ({holder}); wait for it or stop it first"
            raise RunLocked(message) from None
        self._lock_file.seek(0)
        self._lock_file.truncate()
        self._lock_file.write(f"pid {os.getpid()} on {os.uname().nodename}")
        self._lock_file.flush()

    def unlock(self) -> None:
        if self._lock_file is not None:
            fcntl.flock(self._lock_file, fcntl.LOCK_UN)
            self._lock_file.close()
            self._lock_file = None

    # --- manifest -----------------------------------------------------------------------------------------
    def manifest(self) -> dict:
        if not self.manifest_path.exists():
            return {"stages": {}}
        return json.loads(self.manifest_path.read_text())

    def set_stage(self, stage: str, state: str, **info) -> None:
        assert state in STAGE_STATES, state
        manifest = self.manifest()
        entry = manifest["stages"].setdefault(stage, {})
        entry.update(state=state, updated=time.strftime("%Y-%m-%dT%H:%M:%S"), **info)
        write_atomic(self.manifest_path, json.dumps(manifest, indent=1))

    def stage_state(self, stage: str) -> str:
        return self.manifest()["stages"].get(stage, {}).get("state", "pending")

    def stage_output(self, stage: str) -> str | None:
        return self.manifest()["stages"].get(stage, {}).get("output")

    def finished(self) -> dict[str, str | None]:
        """{stage: output} of the stages marked done."""
        return {s: e.get("output") for s, e in self.manifest()["stages"].items() if e.get("state") == "done"}

    def record_config_change(self, changes: dict[str, tuple]) -> None:
        """Note in the manifest that `sse-rl resume --set` changed the config: {key: (old value, new value)}."""
        manifest = self.manifest()
        manifest.setdefault("config_changes", []).append(
            {"time": time.strftime("%Y-%m-%dT%H:%M:%S"),
             "changes": {key: {"from": old, "to": new} for key, (old, new) in changes.items()}})
        write_atomic(self.manifest_path, json.dumps(manifest, indent=1))

    # --- progress -----------------------------------------------------------------------------------------
    def write_progress(self, stage: str, **progress) -> None:
        """`<stage>/progress.json`, which the driver's console reads (pipeline/console.py). Replaced whole by a
        rename, so never read half-written; not fsynced: it is rewritten at every step, and a lost one is harmless."""
        write_atomic(self.stage_dir(stage) / "progress.json", json.dumps(progress), durable=False)

    def read_progress(self, stage: str) -> dict | None:
        try:
            return json.loads((self.stage_dir(stage) / "progress.json").read_text())
        except FileNotFoundError:
            return None

    # --- metrics ------------------------------------------------------------------------------------------
    def log_metrics(self, stage: str, step: int, values: dict) -> None:
        """Append one JSON line. A line cut off by a kill is skipped by `read_metrics`."""
        line = json.dumps({"stage": stage, "step": step, "time": time.time(), **values})
        with open(self.metrics_path, "a+b") as f:  # appends go to the end whatever the position
            if f.tell():  # end a line a kill cut off, so that it does not swallow this one
                f.seek(-1, os.SEEK_END)
                if f.read(1) != b"\n":
                    f.write(b"\n")
            f.write(line.encode() + b"\n")

    def read_metrics(self, stage: str | None = None) -> list[dict]:
        if not self.metrics_path.exists():
            return []
        rows = []
        for line in self.metrics_path.read_text().splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if stage is None or row.get("stage") == stage:
                rows.append(row)
        return rows

    def drop_metrics_after(self, stage: str, step: int) -> None:
        """On resume from checkpoint `step`, forget the stage's metrics logged after it (they will be logged again),
        and the trainer's end-of-training summary (`train_runtime`, ...) logged at it: an attempt killed after its
        last checkpoint logged one there, and the resumed attempt logs its own."""
        def dropped(r):
            return r.get("stage") == stage and (r.get("step", 0) > step or (r.get("step") == step
                                                                            and "train_runtime" in r))

        rows = [r for r in self.read_metrics() if not dropped(r)]
        write_atomic(self.metrics_path, "".join(json.dumps(r) + "\n" for r in rows))
