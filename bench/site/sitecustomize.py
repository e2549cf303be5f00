"""Benchmark-only hooks for every Python process of a run (vLLM's engine-core process too), active when this
folder is on PYTHONPATH and the variable is set:

- SSE_BENCH_STACKS_EVERY_S=60: every 60 s each process appends all its threads' Python stacks to
  $SSE_BENCH_STACKS_DIR/stacks-<pid>.txt (what a silent, hanging engine start is doing).
- SSE_BENCH_ONE_TRITON_CONFIG=1: every autotuned Triton kernel (fla's) runs with one config instead of timing
  all of them, which costs minutes of compilation on a fresh machine; only for correctness runs.
"""
import os

if os.environ.get("SSE_BENCH_STACKS_EVERY_S"):
    import faulthandler

    _stacks = open(os.path.join(os.environ.get("SSE_BENCH_STACKS_DIR", "/tmp"), f"stacks-{os.getpid()}.txt"), "w")
    faulthandler.dump_traceback_later(float(os.environ["SSE_BENCH_STACKS_EVERY_S"]), repeat=True, file=_stacks)

if os.environ.get("SSE_BENCH_ONE_TRITON_CONFIG"):
    from triton.runtime.autotuner import Autotuner

    _prune = Autotuner.prune_configs

    def _first_config(self, *args, **kwargs):
        configs = _prune(self, *args, **kwargs)
        return [next((c for c in configs if c.num_warps == 4), configs[0])]

    Autotuner.prune_configs = _first_config
