"""What `sse-rl run` prints, and where everything else goes.

The console gets one line when a stage starts and when it ends, one line per logged training step, a progress
bar with ETA while a training or eval stage runs (on a terminal), and the eval table at the end. Everything the
libraries print (Ray, Ray Train, vLLM, transformers, TRL, datasets, and the workers' stdout and stderr, which
Ray forwards to the driver) goes to `runs/<name>/logs/<stage>.log`, and what the driver prints outside a stage
(starting and stopping Ray) to `logs/driver.log`; `--verbose` copies those logs to the console too.

The driver learns what the workers do from the run directory, the same on one machine, on a cluster and after a
resume: `metrics.jsonl` rows give the step lines, `<stage>/progress.json` (rank 0 replaces it at every step,
`RunDir.write_progress`) the bar and the checkpoint each attempt started from.
"""
import contextlib
import json
import math
import os
import sys
import threading

from tqdm import tqdm

from pipeline.rundir import RunDir

POLL_SECONDS = 0.5


@contextlib.contextmanager
def output_to(path):
    """Point this process's stdout and stderr at `path` (appending) until the block ends. File descriptors 1 and
    2 are replaced, not `sys.stdout`: C libraries, threads and child processes write there too, and Ray's log
    forwarding prints the workers' lines from a thread of its own."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    try:
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        for target, fd in zip((1, 2), saved):
            os.dup2(fd, target)
            os.close(fd)


class Console:
    """The designed lines, on a copy of stdout taken before any redirection (`Console.of_stdout`)."""

    def __init__(self, stream, verbose: bool = False):
        self.stream, self.verbose = stream, verbose
        self.bar = None

    @classmethod
    def of_stdout(cls, verbose: bool = False) -> "Console":
        sys.stdout.flush()
        return cls(os.fdopen(os.dup(1), "w", buffering=1), verbose)

    def line(self, text: str) -> None:
        if self.bar is not None:
            self.bar.clear()
        print(text, file=self.stream, flush=True)
        if self.bar is not None:
            self.bar.refresh()

    @contextlib.contextmanager
    def follow(self, log_path, run_dir: RunDir | None = None, stage: str | None = None):
        """While the block runs, print `stage`'s step lines and draw its bar from the run directory, and with
        `--verbose` copy what `log_path` gains to the console. One thread polls; it is the only writer meanwhile."""
        follower = _Follower(self, log_path, run_dir, stage)
        stop = threading.Event()

        def loop():
            while not stop.wait(POLL_SECONDS):
                follower.poll()

        thread = threading.Thread(target=loop, name="console", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()
            follower.poll()  # what the stage wrote last
            if self.bar is not None:
                self.bar.close()
                self.bar = None

    def progress(self, desc: str, done: int, total: int, unit: str) -> None:
        """Move the bar (a new one when `desc` changes). Drawn only on a terminal: in a file or a pipe it would be
        a stream of carriage returns."""
        if not self.stream.isatty():
            return
        if self.bar is not None and (self.bar.desc != desc or self.bar.total != total):
            self.bar.close()
            self.bar = None
        if self.bar is None:
            self.bar = tqdm(total=total, initial=done, desc=desc, unit=unit, file=self.stream, leave=False,
                            dynamic_ncols=True)
        self.bar.update(done - self.bar.n)


class _Follower:
    def __init__(self, console: Console, log_path, run_dir: RunDir | None, stage: str | None):
        self.console, self.log_path, self.run_dir, self.stage = console, log_path, run_dir, stage
        self.log_offset = os.path.getsize(log_path) if os.path.exists(log_path) else 0
        self.metrics = _NewRows(run_dir.metrics_path) if run_dir else None
        self.attempts, self.total, self.last_row = set(), None, None

    def poll(self) -> None:
        if self.console.verbose:
            self._copy_log()
        if self.run_dir is None:
            return
        self._progress()
        for row in self.metrics.read():
            if row.get("stage") == self.stage:
                line = step_line(self.stage, row, self.last_row, self.total)
                if line:
                    self.console.line(line)
                    self.last_row = row

    def _copy_log(self) -> None:
        if not os.path.exists(self.log_path):
            return
        with open(self.log_path, "rb") as f:
            f.seek(self.log_offset)
            data = f.read()
        self.log_offset += len(data)
        if data:
            self.console.line(data.decode(errors="replace").rstrip("\n"))

    def _progress(self) -> None:
        progress = self.run_dir.read_progress(self.stage)
        if progress is None:
            return
        attempt = progress.get("attempt")
        if attempt and attempt not in self.attempts:
            self.attempts.add(attempt)
            if progress.get("resumed_from"):
                self.console.line(f"[{self.stage}] resuming from {progress['resumed_from']}")
            elif len(self.attempts) > 1:
                self.console.line(f"[{self.stage}] restarted from the beginning (no checkpoint yet)")
        self.total = progress["total"]
        desc = f"[{self.stage}]" + (f" {progress['what']}" if progress.get("what") else "")
        self.console.progress(desc, progress["done"], progress["total"], progress.get("unit", "step"))


class _NewRows:
    """The rows appended to metrics.jsonl since the last read. A resume rewrites the file (dropping rows past its
    checkpoint): then it is read again from the start, and rows seen before are skipped."""

    def __init__(self, path):
        self.path = path
        self.seen = set()
        self.offset, self.inode = 0, None
        for _ in self.read():  # what is there already is not news
            pass

    def read(self):
        try:
            stat = os.stat(self.path)
        except FileNotFoundError:
            return
        if stat.st_ino != self.inode or stat.st_size < self.offset:
            self.offset, self.inode = 0, stat.st_ino
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            data = f.read()
        end = data.rfind(b"\n") + 1  # a line still being written waits for the next read
        self.offset += end
        for line in data[:end].splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            key = (row.get("stage"), row.get("step"), row.get("time"))
            if key not in self.seen:
                self.seen.add(key)
                yield row


def step_line(stage: str, row: dict, previous: dict | None, total: int | None) -> str | None:
    """The console line of one logged training step, or None for rows that are not steps (the trainer's final
    summary, the GRPO prompt count, eval results)."""
    step = f"[{stage}] step {row['step']}/{total or '?'}"
    if stage == "sft" and "loss" in row:
        parts = [step, f"loss {row['loss']:.4f}", f"lr {row.get('learning_rate', math.nan):.2e}"]
        if previous is not None and "num_tokens" in row and "num_tokens" in previous:
            seconds = row["time"] - previous["time"]
            if seconds > 0:
                parts.append(f"{(row['num_tokens'] - previous['num_tokens']) / seconds:,.0f} tokens/s")
        return "  ".join(parts)
    if stage == "grpo" and "reward" in row:
        per_function = [f"{key.split('/')[1]} {value:.3f}" for key, value in row.items()
                        if key.startswith("rewards/") and key.endswith("/mean")]
        parts = [step, f"reward {row['reward']:.3f}" + (f" ({', '.join(per_function)})" if per_function else "")]
        for key, label, fmt in (("vllm_parity", "parity", ".1e"), ("sampling/kl_rollout_trainer", "rollout_kl", ".1e"),
                                ("kl", "kl", ".4f"),
                                ("clip_ratio/region_mean", "clip", ".3f"),
                                ("completions/mean_length", "length", ".0f"), ("step_time", "s/step", ".1f")):
            if key in row:
                parts.append(f"{label} {row[key]:{fmt}}" if label != "s/step" else f"{row[key]:{fmt}} s/step")
        return "  ".join(parts)
    return None
