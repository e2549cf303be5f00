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
    renamed norm kernel once broke bench/layer_host_ablate.py): every name they import from the project exists."""
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
