"""Files that a reader may see at any moment, or that a resume reads after a kill: replaced whole, never seen
half-written. The one writer of the run directory (pipeline/) and of evaluation outputs (eval/); here, in the
layer both import.

A new version is written to a temporary name beside the file and renamed over it: os.replace is atomic on POSIX
within one file system, so a reader, or the disk after a kill at any moment, holds the old version or the new.
"""
import os
import shutil
from pathlib import Path


def write_atomic(path: str | Path, data: str | bytes, *, durable: bool = True) -> None:
    """Replace `path` with `data` (text as UTF-8). On an exception nothing is left behind: `path` keeps its old
    version and the temporary file is removed. `durable`: fsync the file and its directory before returning, so
    the new version also survives a crash of the machine; off for a file rewritten at every step, where losing
    the last version is harmless and an fsync each time is not."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")  # per process: two writers never share one
    try:
        with open(tmp, "wb") as f:
            f.write(data.encode("utf-8") if isinstance(data, str) else data)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if durable:
        fsync_dir(path.parent)


def replace_dir(staging: str | Path, path: str | Path) -> None:
    """Put the complete directory `staging` where `path` is (an older `path` is removed first), durably. A
    directory cannot be renamed over a non-empty one, so a kill between the two steps leaves no `path` and
    `staging` complete: readers look only for `path`, which is never partial."""
    path = Path(path)
    shutil.rmtree(path, ignore_errors=True)
    os.rename(staging, path)
    fsync_dir(path.parent)


def fsync_dir(path: str | Path) -> None:
    """Make the entries of directory `path` (a rename into it) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
