"""The installed project: console script, and no confusion between our `kernels` and transformers' hub kernels."""
import subprocess
import sys
from pathlib import Path


def test_console_script_help():
    script = Path(sys.executable).with_name("sse-rl")
    out = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    for command in ("run", "resume", "eval", "convert"):
        assert command in out.stdout


def test_python_dash_m_pipeline_help():
    out = subprocess.run([sys.executable, "-m", "pipeline", "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "sse-rl" in out.stdout


def test_our_kernels_package_is_not_mistaken_for_hub_kernels():
    """transformers probes for an importable `kernels` (the Hugging Face hub-kernels package). Ours has the same
    import name; transformers must judge it unusable (its version window does not admit our distribution), and
    importing transformers, TRL and our kernels together must work, in a fresh interpreter."""
    code = """
import transformers, trl
from transformers.utils import import_utils
from transformers.integrations import hub_kernels
import kernels
from kernels import sse_attention
assert kernels.__file__.endswith('kernels/__init__.py') and 'site-packages' not in kernels.__file__, kernels.__file__
assert not import_utils.is_kernels_available(), 'transformers thinks our kernels is the hub-kernels package'
assert not hasattr(hub_kernels, 'get_kernel') or hub_kernels.get_kernel.__module__ != 'kernels'
from sse_model import SSEForCausalLM
print('ok')
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]


def test_bench_scripts_import_names_the_project_has():
    """The benchmarks run only on a GPU node, so a renamed kernel or function would break them unnoticed (as a
    renamed norm kernel once broke a bench script): every name they import from the project exists."""
    import ast
    import importlib
    repo = Path(__file__).resolve().parents[1]
    missing = []
    for script in sorted((repo / "bench").glob("*.py")):
        for node in ast.walk(ast.parse(script.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in (
                    "kernels", "sse_model", "pipeline", "rewards", "eval", "tasks"):
                module = importlib.import_module(node.module)
                missing += [f"{script.name}: {node.module}.{a.name}" for a in node.names if not hasattr(module, a.name)
                            and importlib.util.find_spec(f"{node.module}.{a.name}") is None]
    assert missing == []


def test_wheelhouse_builder_plans_the_gpu_nodes_wheels_offline(tmp_path):
    """scripts/build-wheelhouse.sh --dry-run prints its plan without network and writes nothing: CPython 3.12
    manylinux x86_64 wheels of vLLM 0.25 and of the versions pyproject.toml's `train` and `gpu` extras pin, the
    project's own wheel, parts of at most 58 MiB and the node's install script; the node's installer uses it."""
    import re
    import tomllib

    repo = Path(__file__).resolve().parents[1]
    out = tmp_path / "wheelhouse"
    run = subprocess.run(["bash", repo / "scripts" / "build-wheelhouse.sh", "--dry-run", out], capture_output=True,
                         text=True, timeout=60, env={"PATH": "/usr/bin:/bin"})  # no python on PATH: pip never runs
    assert run.returncode == 0, run.stderr
    assert not out.exists()
    plan = dict(line.split(": ", 1) for line in run.stdout.splitlines())
    assert plan["target"].startswith("CPython 3.12, manylinux_2_28_x86_64") and "manylinux2014_x86_64" in plan["target"]
    download = plan["download"].split()
    assert download[:4] == ["python3", "-m", "pip", "download"] and "--only-binary=:all:" in download
    assert download[download.index("--python-version") + 1] == "3.12"
    assert download[download.index("-d") + 1] == f"{out}/download"
    extras = tomllib.loads((repo / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    pinned = [re.sub(r"\[.*\]", "", spec) for spec in extras["train"] + extras["gpu"] if "==" in spec]
    assert {"vllm==0.25.0", "trl==1.16.0", "ray==2.60.0", "datasets==5.2.0"} <= set(pinned)
    wanted = set(pinned) - {"torch==2.11.0"}  # torch is the node's own
    assert wanted <= set(download), wanted - set(download)
    assert plan["project"] == f"python3 -m pip wheel -q --no-deps -w {out}/download {repo}"
    assert plan["strip from vllm==0.25.0"].split()[0] == "vllm/vllm_flash_attn/_vllm_fa2_C"
    assert "at most 58 MiB each" in plan["parts"] and plan["install script"].startswith(f"{out}/part-1/install.sh")

    no_ray = subprocess.run(["bash", repo / "scripts" / "build-wheelhouse.sh", "--dry-run", "--no-ray", out],
                            capture_output=True, text=True, timeout=60, env={"PATH": "/usr/bin:/bin"})
    without = dict(line.split(": ", 1) for line in no_ray.stdout.splitlines())["download"].split()
    assert no_ray.returncode == 0 and "ray==2.60.0" in download and "ray==2.60.0" not in without
    assert set(without) == set(download) - {"ray==2.60.0", "jsonschema==4.26.0", "jsonschema-specifications==2025.9.1",
                                            "referencing==0.37.0", "rpds-py==2026.9.1"}

    usage = subprocess.run(["bash", repo / "scripts" / "build-wheelhouse.sh"], capture_output=True, text=True)
    assert usage.returncode == 2 and "--dry-run OUT" in usage.stdout and "--no-ray OUT" in usage.stdout
    installer = (repo / "scripts" / "gpu-offline-install.sh").read_text()
    assert "scripts/build-wheelhouse.sh" in installer and "shared/tools" not in installer
