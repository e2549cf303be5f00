"""Where the entry points write: raw runs under bench/runs/ (gitignored, one file per run), and the one committed
baseline per configuration, bench/results/<configuration>.json, which `--baseline` overwrites and from which
`python -m bench.report` generates docs/performance.md and README.md's table.

A baseline holds what a reader needs to trust and redo it: the device, the date, the commit measured, the command,
a `title`, its `rows` (one dict per table row, every row with the same keys) and, where the README quotes it, a
`headline` ({"label", "value"}: the one number of its row in "Where the project stands").
"""
import json
import os
import platform
import shlex
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RUNS = REPO / "bench" / "runs"
RESULTS = REPO / "bench" / "results"


def now() -> datetime:
    return datetime.now(timezone.utc)


def cpu_name() -> str:
    """The CPU's model name and usable cores, for a CPU run's `device`: timings on shared VMs differ by CPU model
    (an Intel Xeon VM ran the CPU SSE operator about 2x slower than an AMD EPYC one)."""
    name = platform.processor() or platform.machine()
    try:
        name = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{name}, {len(os.sched_getaffinity(0))} of {os.cpu_count()} cores usable"


def raw_path(name: str, suffix: str, when: datetime | None = None) -> Path:
    """bench/runs/<name>_<UTC date-time>.<suffix>, its folder created."""
    RUNS.mkdir(parents=True, exist_ok=True)
    return RUNS / f"{name}_{(when or now()):%Y%m%d-%H%M}.{suffix}"


def commit() -> str:
    """The checkout's short commit, with "-dirty" when tracked files differ from it (the numbers are then of a
    tree no commit holds)."""
    def git(*args):
        return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True).stdout.strip()
    head = git("rev-parse", "--short", "HEAD") or "unknown"
    return head + ("-dirty" if git("status", "--porcelain", "--untracked-files=no") else "")


def command(module: str, argv: list[str]) -> str:
    """The command line that reproduces a run: `python -m bench.<name> ARGS` without `--baseline`."""
    return shlex.join(["python", "-m", module, *[a for a in argv if a != "--baseline"]])


def write_baseline(configuration: str, *, device: str, title: str, rows: list[dict], command: str,
                   headline: dict | None = None, date: str | None = None, commit_id: str | None = None,
                   **extra) -> Path:
    """Overwrites bench/results/<configuration>.json; `date` and `commit_id` default to now and this checkout."""
    if not rows or any(set(r) != set(rows[0]) for r in rows):
        raise ValueError(f"{configuration}: a baseline needs rows, all with the same keys")
    data = dict(device=device, date=date or now().date().isoformat(), commit=commit_id or commit(), command=command,
                title=title, rows=rows, **({"headline": headline} if headline else {}), **extra)
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{configuration}.json"
    path.write_text(json.dumps(data, indent=1) + "\n")
    print(f"baseline written: {path}", file=sys.stderr)
    return path


def load_baselines(folder: Path = RESULTS) -> dict[str, dict]:
    """Every baseline by configuration name, in name order."""
    return {p.stem: json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))}
