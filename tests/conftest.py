"""Shared test helpers: random SSE inputs, relative error that never lets NaN pass, the shared data folder, and
the separate processes of the tests marked `triton_interpret` (TRITON_INTERPRET=1) or `exact_f32_dots`."""
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

SHARED_DATA = Path(os.environ.get("SSE_RL_SHARED_DATA", Path(__file__).resolve().parents[2] / "shared" / "data"))


def shared_data_file(name: str) -> Path:
    """A file of ../shared/data. Outside CI a missing folder skips the test; under CI (CI=true) it fails."""
    path = SHARED_DATA / name
    if not path.exists():
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"{path} is missing: CI must have ../shared/data next to the checkout")
        pytest.skip(f"{path} not present (../shared/data is needed for this test)")
    return path


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||a - e|| / ||e||, computed in float64; NaN or inf anywhere gives inf so no comparison can pass on it."""
    a, e = actual.detach().double(), expected.detach().double()
    if not (torch.isfinite(a).all() and torch.isfinite(e).all()):
        return float("inf")
    return float((a - e).norm() / e.norm().clamp(min=1e-300))


def sse_inputs(B, T, H, c, dv, N, *, shared=True, dtype=torch.float64, seed=0, requires_grad=False,
               never_route=(), shared_decay=False):
    """Fresh random inputs for `kernels.sse_attention`. `never_route` partitions get a large negative router bias
    so no token selects them (empty partitions); `shared_decay` adds the shared partition's own log-decay."""
    g = torch.Generator().manual_seed(seed)

    def r(*s):
        return torch.randn(*s, generator=g, dtype=torch.float64)

    router = r(B, T, N)
    for p in never_route:
        router[..., p] -= 50.0
    x = dict(q=r(B, T, H, c), k_logits=r(B, T, H, c), v=r(B, T, H, dv),
             log_decay=F.logsigmoid(r(B, T, H, c) + 2) / 4, router_logits=router)
    if shared:
        x.update(q_shared=r(B, T, H, c), k_shared_logits=r(B, T, H, c))
    if shared_decay:
        x.update(log_decay_shared=F.logsigmoid(r(B, T, H, c) + 1) / 4)
    return {k: v.to(dtype).requires_grad_(requires_grad) for k, v in x.items()}


# ---------------------------------------------------------------------------------------------------------------
# Tests with one of these markers run in one separate pytest process per marker, with the marker's environment:
# - `triton_interpret` (the cpu cases of tests/test_triton_kernels.py): TRITON_INTERPRET=1. Triton decides whether
#   a kernel is interpreted when the kernel is decorated, i.e. when its module is imported, so the variable must be
#   set before anything imports the kernels, and a run that also holds cuda cases needs them compiled.
# - `exact_f32_dots` (gpu cases): TRITON_F32_DEFAULT=ieee, float32 dots without tf32 rounding. Triton reads it
#   when it compiles a kernel and keeps compiled kernels per process, so it too must be set before the first launch.
# The first such test to run starts its marker's process for all the selected ones; each then reports its own
# outcome from there, with what it printed.
SEPARATE_PROCESSES = {"triton_interpret": {"TRITON_INTERPRET": "1"}, "exact_f32_dots": {"TRITON_F32_DEFAULT": "ieee"}}
SEPARATE_REPORT = "SSE_TEST_SEPARATE_REPORT"  # set in such a process: the file its outcomes go to
_separate_outcomes: dict[str, dict] = {}


def separate_marker(item) -> str | None:
    """The marker that sends this test to a separate process, if any."""
    return next((name for name in SEPARATE_PROCESSES if item.get_closest_marker(name)), None)


def runs_here(item) -> bool:
    """Whether this process runs the test itself (rather than collecting its outcome from a separate one)."""
    return separate_marker(item) is None or bool(os.environ.get(SEPARATE_REPORT))


def _run_separately(session, marker: str) -> None:
    nodeids = [item.nodeid for item in session.items if separate_marker(item) == marker]
    root = session.config.rootpath
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "outcomes.jsonl"
        env = {**os.environ, **SEPARATE_PROCESSES[marker], SEPARATE_REPORT: str(report),
               "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
        # -m "": the node ids are the selection (addopts deselects gpu tests)
        done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "", *nodeids],
                              cwd=root, env=env, capture_output=True, text=True, timeout=1800)
        for line in report.read_text().splitlines() if report.exists() else []:
            outcome = json.loads(line)
            _separate_outcomes[outcome["nodeid"]] = outcome  # a later phase's failure replaces a pass
    for nodeid in nodeids:
        _separate_outcomes.setdefault(nodeid, {"outcome": "failed", "text": f"no outcome (exit {done.returncode})"
                                               f"\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"})


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    if runs_here(pyfuncitem):
        return None  # pytest runs the test here
    marker = separate_marker(pyfuncitem)
    if pyfuncitem.nodeid not in _separate_outcomes:
        _run_separately(pyfuncitem.session, marker)
    outcome = _separate_outcomes[pyfuncitem.nodeid]
    if outcome["outcome"] == "skipped":
        pytest.skip(outcome["text"])
    if outcome["outcome"] != "passed":
        env = " ".join(f"{k}={v}" for k, v in SEPARATE_PROCESSES[marker].items())
        pytest.fail(f"in the {env} process:\n{outcome['text']}", pytrace=False)
    return True


def pytest_runtest_logreport(report):
    path = os.environ.get(SEPARATE_REPORT)
    if path and (report.when == "call" or report.outcome != "passed"):
        text = report.longreprtext + "".join(f"\n--- {name} ---\n{content}" for name, content in report.sections)
        with open(path, "a") as f:
            f.write(json.dumps({"nodeid": report.nodeid, "outcome": report.outcome, "text": text}) + "\n")


@pytest.fixture(scope="module")
def one_triton_config():
    """fla autotunes every kernel per dtype and shape on first use (minutes on a fresh GPU node), and correctness
    does not depend on the tuning: each autotuned kernel runs with one config, in this process and, through
    tests/site's sitecustomize on PYTHONPATH, in the processes a test starts (vLLM's engine core)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    import runpy

    from triton.runtime.autotuner import Autotuner
    site = str(Path(__file__).resolve().parent / "site")
    saved = Autotuner.prune_configs, dict(os.environ)
    os.environ["SSE_TESTS_ONE_TRITON_CONFIG"] = "1"
    os.environ["PYTHONPATH"] = os.pathsep.join([site, os.environ.get("PYTHONPATH", "")])
    runpy.run_path(os.path.join(site, "sitecustomize.py"))
    yield
    Autotuner.prune_configs = saved[0]
    os.environ.clear()
    os.environ.update(saved[1])

