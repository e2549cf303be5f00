"""vLLM plugin: makes `vllm.LLM(model=CKPT)` and `vllm serve CKPT` load SSE-H checkpoints.

vLLM finds `register` through the `vllm.general_plugins` entry point in pyproject.toml and calls it in every
process it starts (front end, engine core, workers, the model-inspection subprocess), possibly more than once.
"""


def register() -> None:
    import importlib.util
    import os

    from transformers import AutoConfig
    from vllm import ModelRegistry
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP
    from vllm.platforms import current_platform

    from sse_model import vllm_state_cache
    from sse_model.configuration_sse import SSEConfig
    from sse_model.vllm_engine_config import SSEEngineConfig

    AutoConfig.register(SSEConfig.model_type, SSEConfig, exist_ok=True)
    if "SSEForCausalLM" not in ModelRegistry.get_supported_archs():
        # The class itself, not the lazy "module:class" form: vLLM inspects a lazily registered model in a fresh
        # Python subprocess the first time on each machine (then caches it under VLLM_CACHE_ROOT/modelinfos),
        # which took 25-27 s of an engine's start on a fresh GPU node. By the time plugins load, vLLM has
        # imported everything the model module imports, so importing it here takes ~10 ms and no CUDA.
        from sse_model.vllm_model import SSEForCausalLM

        ModelRegistry.register_model("SSEForCausalLM", SSEForCausalLM)
    MODELS_CONFIG_MAP.setdefault("SSEForCausalLM", SSEEngineConfig)  # engine defaults for SSE states
    vllm_state_cache.register()  # the scheduler's manager of the SSE states' cache group
    if current_platform.is_cpu():
        rewind_seeded_generators_on_cpu()
    if importlib.util.find_spec("flashinfer") is None:
        # vLLM lists flashinfer as a CUDA requirement, and 0.25's sampler imports it unguarded unless this is 0
        # (an engine whose logprobs mode is the default dies at start without it). Air-gapped installs often
        # leave it out; PyTorch's top-k/top-p sampling is what vLLM falls back to anyway.
        os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")


class _RestoreState:
    """Stands in for a CPU generator in vLLM's rewind `gen.set_offset(gen.get_offset() - 4)`: puts back the
    state the generator had before the discarded sample."""

    def __init__(self, generator, state):
        self.generator, self.state = generator, state

    def get_offset(self) -> int:
        return 0

    def set_offset(self, offset: int) -> None:
        self.generator.set_state(self.state)


def rewind_seeded_generators_on_cpu() -> None:
    """vLLM samples a token for a request whose prefill is only partly scheduled (chunked prefill), discards it,
    and rewinds the request's seeded generator with `set_offset`, which only CUDA generators have: on the CPU
    build a seeded request whose prefill was split crashed the engine ("CPU Generator does not use offset").
    The CPU runner here saves those generators' states before sampling and restores them instead, so a seeded
    request samples the same tokens however its prefill is split (GRPO's and eval's per-request seeds rely
    on that). Patched once per process, on the CPU runner only."""
    import numpy as np
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    if getattr(CPUModelRunner, "_sse_restores_generators", False):
        return
    sample, bookkeeping = CPUModelRunner._sample, CPUModelRunner._bookkeeping_sync

    def _sample(self, *args, **kwargs):
        generators = self.input_batch.generators
        discarded = np.nonzero(self.discard_request_mask.np[:self.input_batch.num_reqs])[0].tolist()
        self._sse_saved_states = {i: generators[i].get_state() for i in discarded if i in generators}
        return sample(self, *args, **kwargs)

    def _bookkeeping_sync(self, *args, **kwargs):
        saved, self._sse_saved_states = getattr(self, "_sse_saved_states", {}), {}
        generators = self.input_batch.generators
        self.input_batch.generators = {**generators, **{i: _RestoreState(generators[i], state)
                                                        for i, state in saved.items()}}
        try:
            return bookkeeping(self, *args, **kwargs)
        finally:
            self.input_batch.generators = generators

    CPUModelRunner._sample, CPUModelRunner._bookkeeping_sync = _sample, _bookkeeping_sync
    CPUModelRunner._sse_restores_generators = True
