"""Run calls in worker processes with a hard deadline per call.

Why not math-verify's own timeout: it uses `signal.alarm`, which raises in any thread but the main one and
cannot interrupt a long C-level computation (sympy asked for 10^(10^10) spends its time in one bignum
operation). Why not `concurrent.futures`: a stuck worker cannot be killed without breaking the whole pool.

So each worker is a plain subprocess (`python -c "...rewards.pool.serve..."`) that talks over a socket pair. A call that
misses its deadline gets its worker killed and replaced; the other workers keep going. Subprocesses, not
`multiprocessing`, so this works from any thread, from daemonic processes (which may not have
multiprocessing children), without an `if __name__ == "__main__"` guard and without re-importing the
caller's main module. Workers start once and are reused, so a call costs one socket round trip.
"""
import atexit
import importlib
import logging
import os
import resource
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from multiprocessing.connection import Connection, wait

logger = logging.getLogger(__name__)

_READY = "ready"
_STARTUP_TIMEOUT_S = 120.0


def default_num_workers() -> int:
    """Workers for the process-wide pool: the CPUs this process may use, at most 8 (env SSE_RL_GRADER_WORKERS)."""
    if "SSE_RL_GRADER_WORKERS" in os.environ:
        return max(1, int(os.environ["SSE_RL_GRADER_WORKERS"]))
    return max(1, min(8, len(os.sched_getaffinity(0))))


class _Worker:
    def __init__(self, preload: tuple[str, ...], memory_limit_mb: int):
        ours, theirs = socket.socketpair()
        # The child must import the same packages as this process, whatever way they were made importable.
        paths = [p or os.getcwd() for p in sys.path]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths))
        self.proc = subprocess.Popen(
            [sys.executable, "-c", "import sys; from rewards.pool import serve; serve(sys.argv[1:])",
             str(theirs.fileno()), str(os.getpid()), str(memory_limit_mb), *preload],
            pass_fds=[theirs.fileno()], env=env, stdin=subprocess.DEVNULL,
            start_new_session=True,  # a Ctrl-C in the terminal is for the parent, which then closes the pool
        )
        theirs.close()
        self.conn = Connection(ours.detach())
        self.ready = False
        self.ready_deadline = time.monotonic() + _STARTUP_TIMEOUT_S
        self.task: tuple[int, float] | None = None  # (item index, deadline) of the call in flight

    def kill(self):
        self.proc.kill()
        self.proc.wait()
        self.conn.close()


class DeadlinePool:
    """`map(fn, items, timeout)` over worker processes, each call limited to `timeout` seconds of wall time.

    `fn` must be importable by name (a module-level function); `preload` names modules each worker imports
    before it reports ready, so their import time never counts against a deadline. Safe to share between
    threads (calls are serialised). Workers use at most `memory_limit_mb` of address space each, so a
    computation that explodes fails with MemoryError instead of taking the machine down.
    """

    def __init__(self, num_workers: int, preload: tuple[str, ...] = (), memory_limit_mb: int = 4096):
        self.num_workers = num_workers
        self.preload = tuple(preload)
        self.memory_limit_mb = memory_limit_mb
        self._workers: list[_Worker] = []
        self._lock = threading.Lock()
        self._pid = os.getpid()

    def map(self, fn, items: list[tuple], timeout: float) -> list[tuple[str, object]]:
        """One outcome per item, in order: ("ok", fn(*item)), ("error", "Type: message") or ("timeout", None)."""
        with self._lock:
            if os.getpid() != self._pid:  # a forked copy must not talk to its parent's workers
                self._workers, self._pid = [], os.getpid()
            while len(self._workers) < self.num_workers:
                self._workers.append(_Worker(self.preload, self.memory_limit_mb))
            return self._run(fn, items, timeout)

    def close(self):
        with self._lock:
            for worker in self._workers:
                worker.kill()
            self._workers = []

    def _run(self, fn, items, timeout):
        results: list = [None] * len(items)
        todo = deque(range(len(items)))
        while todo or any(w.task for w in self._workers):
            for w in self._workers:
                if w.ready and w.task is None and todo:
                    index = todo.popleft()
                    w.task = (index, time.monotonic() + timeout)
                    try:
                        w.conn.send((fn, items[index]))
                    except OSError:  # it died while idle: wait() reports EOF and the item gets an error
                        pass
            waiting = [w for w in self._workers if not w.ready or w.task]
            deadline = min(w.task[1] if w.task else w.ready_deadline for w in waiting)
            ready = set(wait([w.conn for w in waiting], timeout=max(0.0, deadline - time.monotonic())))
            for w in list(self._workers):
                if w.conn in ready:
                    self._receive(w, results)
            now = time.monotonic()
            for w in list(self._workers):
                if w.task and w.task[1] <= now:
                    results[w.task[0]] = ("timeout", None)
                    self._replace(w)
                elif not w.ready and w.ready_deadline <= now:
                    raise RuntimeError(f"a grading worker did not start within {_STARTUP_TIMEOUT_S:.0f} s")
        return results

    def _receive(self, w: _Worker, results: list):
        try:
            message = w.conn.recv()
        except (EOFError, OSError):
            code = w.proc.wait()
            if not w.ready:
                raise RuntimeError(f"a grading worker exited with code {code} before it was ready "
                                   "(its error is above, on stderr)") from None
            if w.task:
                results[w.task[0]] = ("error", f"worker process died (exit code {code})")
            self._replace(w)
            return
        if message == _READY:
            w.ready = True
        else:
            results[w.task[0]] = message
            w.task = None

    def _replace(self, w: _Worker):
        w.kill()
        self._workers[self._workers.index(w)] = _Worker(self.preload, self.memory_limit_mb)


_shared: DeadlinePool | None = None
_shared_lock = threading.Lock()


def shared_pool() -> DeadlinePool:
    """The process-wide grading pool (started on first use, closed at exit)."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = DeadlinePool(default_num_workers(), preload=("rewards.accuracy",))
            atexit.register(_shared.close)
        return _shared


# ---------------------------------------------------------------------------------------------------- worker

def _exit_with_parent(parent_pid: int):
    # Stops a worker orphaned by a killed parent. (A worker stuck inside one C call cannot run this thread;
    # its memory limit ends such computations.)
    while os.getppid() == parent_pid:
        time.sleep(1.0)
    os._exit(1)


def serve(argv: list[str]):
    """A worker's main loop. argv: socket fd, parent pid, memory limit in MB, modules to preload."""
    fd, parent_pid, memory_limit_mb, preload = int(argv[0]), int(argv[1]), int(argv[2]), argv[3:]
    limit = memory_limit_mb * 2**20
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    conn = Connection(fd)
    for name in preload:
        importlib.import_module(name)
    threading.Thread(target=_exit_with_parent, args=(parent_pid,), daemon=True).start()
    conn.send(_READY)
    while True:
        try:
            fn, args = conn.recv()
        except EOFError:  # the parent closed the pool
            return
        try:
            outcome = ("ok", fn(*args))
        except BaseException as e:  # RecursionError, MemoryError, ... are answers too
            outcome = ("error", f"{type(e).__name__}: {str(e)[:300]}")
        conn.send(outcome)

