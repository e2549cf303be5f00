"""vLLM plugin: makes `vllm.LLM(model=CKPT)` and `vllm serve CKPT` load SSE-H checkpoints.

vLLM finds `register` through the `vllm.general_plugins` entry point in pyproject.toml and calls it in every
process it starts (front end, engine core, workers, the model-inspection subprocess), possibly more than once.
"""
import faulthandler
import os
import signal
import tempfile
from pathlib import Path

# Where each vLLM process that dumps its stacks on request (`stacks_on_request`) leaves its pid: a process is sent
# the signal only once it has a handler, since SIGUSR1's default action ends the process.
STACK_DUMPERS = Path(tempfile.gettempdir()) / "sse-rl-stack-dumpers"


def stacks_on_request() -> None:
    """SIGUSR1 makes this process write every thread's stack to its stderr (`eval.engine.reporting_slow_start`
    sends it while an engine start takes long, so a stalled start shows where each vLLM process waits)."""
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    STACK_DUMPERS.mkdir(exist_ok=True)
    (STACK_DUMPERS / str(os.getpid())).touch()


def register() -> None:
    from transformers import AutoConfig
    from vllm import ModelRegistry
    from vllm.platforms import current_platform

    from sse_model.configuration_sse import SSEConfig
    from sse_model.vllm import engine, seams

    stacks_on_request()
    AutoConfig.register(SSEConfig.model_type, SSEConfig, exist_ok=True)
    if "SSEForCausalLM" not in ModelRegistry.get_supported_archs():
        # The class itself, not the lazy "module:class" form: vLLM inspects a lazily registered model in a fresh
        # Python subprocess the first time on each machine (then caches it under VLLM_CACHE_ROOT/modelinfos), a
        # whole Python start and vLLM import in every fresh node's first engine start. By the time plugins load,
        # vLLM has imported everything the model module imports, so importing it here is cheap and needs no CUDA.
        from sse_model.vllm.model import SSEForCausalLM

        ModelRegistry.register_model("SSEForCausalLM", SSEForCausalLM)
    seams.register_engine_config("SSEForCausalLM", engine.verify_and_update_config)  # engine defaults for states
    seams.register_cache_managers()  # the scheduler's managers of the hybrid's two cache groups
    if current_platform.is_cpu():
        seams.rewind_seeded_generators_on_cpu()
    else:
        seams.spawn_engine_processes()  # a forked engine core can stall silently on the GPU nodes
    seams.sampler_without_flashinfer()
    seams.record_routes_per_request()  # a no-op for engines without route recording (sse_model/vllm/routes.py)
