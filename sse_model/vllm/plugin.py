"""vLLM plugin: makes `vllm.LLM(model=CKPT)` and `vllm serve CKPT` load SSE-H checkpoints.

vLLM finds `register` through the `vllm.general_plugins` entry point in pyproject.toml and calls it in every
process it starts (front end, engine core, workers, the model-inspection subprocess), possibly more than once.
"""


def register() -> None:
    from transformers import AutoConfig
    from vllm import ModelRegistry
    from vllm.platforms import current_platform

    from sse_model.configuration_sse import SSEConfig
    from sse_model.vllm import engine, seams

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
    seams.sampler_without_flashinfer()
    seams.record_routes_per_request()  # a no-op for engines without route recording (sse_model/vllm/routes.py)
