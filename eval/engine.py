"""vLLM engine settings and the eval engine. `EngineSettings` are what any of the project's engines takes (the GRPO
rollout engine's `grpo.vllm` extends them in pipeline/config.py); `EvalEngineSettings` are the eval engine's, read
from a run config's `eval.vllm` by the eval stage and from the engine options of `sse-rl eval`."""
import contextlib
import faulthandler
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from typing import Literal

import psutil

EngineDtype = Literal["auto", "float32", "bfloat16", "float16"]
StateDtype = Literal["auto", "float32", "bfloat16"]


@dataclass(frozen=True, kw_only=True)
class EngineSettings:
    # A fraction of the GPU's memory; on the CPU build a fraction of RAM, unless kv_cache_gib sizes the KV cache.
    gpu_memory_utilization: float = 0.9  # vLLM's default: the engine has the device to itself
    kv_cache_gib: int | None = None  # KV cache size in GiB on the CPU build (VLLM_CPU_KVCACHE_SPACE, an integer)
    max_num_seqs: int | None = None  # None: vLLM's default
    # "auto": in a run, model.dtype (the checkpoints are float32 under model.fp32_master_weights); for
    # `sse-rl eval`, the checkpoint's own.
    dtype: EngineDtype = "auto"
    # vLLM's enforce_eager: no torch.compile (nor CUDA graphs). On the CPU build each engine start compiles the
    # model with inductor (vLLM's AOT cache fails to load it back), which a small model does not earn back in
    # decoding speed. `python -m bench.rollouts` times engine start and decoding (`--engine '{"enforce_eager":
    # true}'` for the eager side).
    enforce_eager: bool = False
    # How the engine stores SSE states (vLLM's mamba_ssm_cache_dtype): "auto" is int16 fixed point for a 16-bit
    # engine (half of float32's bytes, within 6e-4 of float64 after 4k decode steps) and float32 for a float32 one.
    # bfloat16 also halves the bytes but drops updates below a state's last bit: 8-14 % relative error after 4k
    # steps where a gate keeps memory long (docs/vllm-backend.md, "SSE state"), so its samples drift from the
    # trainer's model as they grow.
    state_dtype: StateDtype = "auto"


@dataclass(frozen=True, kw_only=True)
class EvalEngineSettings(EngineSettings):
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    tensor_parallel_size: int = 1


def set_cpu_kv_cache(settings: EngineSettings) -> None:
    """Before an engine starts in this process: the CPU build sizes its KV cache from VLLM_CPU_KVCACHE_SPACE (GiB),
    not from an LLM argument, so `kv_cache_gib` goes into the environment."""
    if settings.kv_cache_gib is not None:
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(settings.kv_cache_gib)


# How long an engine start may take before it is reported, and how often after that: a cold start of a 2B model
# (torch.compile and CUDA graph capture included) takes a minute or two; past that, a start that stalls says where.
START_REPORT_S = 180.0


@contextlib.contextmanager
def reporting_slow_start(what: str, every_s: float | None = None):
    """While an engine starts inside the block: every `every_s` seconds (START_REPORT_S by default), write to
    stderr that `what` is still starting, with the stacks of this process's threads and of every vLLM process it
    started (the plugin makes them dump theirs on SIGUSR1), so a start that stalls says what it waits on instead of
    hanging silently."""
    from sse_model.vllm.plugin import STACK_DUMPERS

    every_s = START_REPORT_S if every_s is None else every_s
    started, done = time.monotonic(), threading.Event()

    def watch():
        while not done.wait(every_s):
            print(f"{what}: the vLLM engine is still starting after {time.monotonic() - started:.0f} s; where its "
                  "processes are:", file=sys.stderr, flush=True)
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
            for child in psutil.Process().children(recursive=True):
                if (STACK_DUMPERS / str(child.pid)).exists():
                    os.kill(child.pid, signal.SIGUSR1)

    watcher = threading.Thread(target=watch, name="engine-start-watch", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        done.set()
        watcher.join()


def build_llm(model: str, settings: EvalEngineSettings, *, seed: int = 0):
    """A vLLM engine for a checkpoint directory (or Hub id)."""
    from vllm import LLM  # here, so that importing this module does not import vLLM

    set_cpu_kv_cache(settings)
    s = settings
    with reporting_slow_start(f"the eval engine for {model}"):
        return LLM(model=model, seed=seed, dtype=s.dtype, max_model_len=s.max_model_len, max_num_seqs=s.max_num_seqs,
               gpu_memory_utilization=s.gpu_memory_utilization, tensor_parallel_size=s.tensor_parallel_size,
               enforce_eager=s.enforce_eager, mamba_ssm_cache_dtype=s.state_dtype)
