"""Imported by every Python process whose PYTHONPATH holds this folder (Python's `site` imports `sitecustomize`):
the way a test reaches the processes it starts, vLLM's engine core among them. tests/conftest.py's
`one_triton_config` fixture puts it there.

SSE_TESTS_ONE_TRITON_CONFIG=1: every autotuned Triton kernel (fla's) runs with one config instead of timing all of
them, which costs minutes of compilation on a fresh GPU node; correctness does not depend on the tuning.
"""
import os

if os.environ.get("SSE_TESTS_ONE_TRITON_CONFIG"):
    from triton.runtime.autotuner import Autotuner

    _prune = Autotuner.prune_configs

    def _first_config(self, *args, **kwargs):
        configs = _prune(self, *args, **kwargs)
        return [next((c for c in configs if c.num_warps == 4), configs[0])]

    Autotuner.prune_configs = _first_config
