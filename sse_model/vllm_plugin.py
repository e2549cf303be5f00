"""vLLM plugin: makes `vllm.LLM(model=CKPT)` and `vllm serve CKPT` load SSE-H checkpoints.

vLLM finds `register` through the `vllm.general_plugins` entry point in pyproject.toml and calls it in every
process it starts (front end, engine core, workers, the model-inspection subprocess), possibly more than once.
"""


def register() -> None:
    from transformers import AutoConfig
    from vllm import ModelRegistry

    from sse_model.configuration_sse import SSEConfig

    AutoConfig.register(SSEConfig.model_type, SSEConfig, exist_ok=True)
    if "SSEForCausalLM" not in ModelRegistry.get_supported_archs():
        # Lazy "module:class" form: vLLM imports the model only where it builds it.
        ModelRegistry.register_model("SSEForCausalLM", "sse_model.vllm_model:SSEForCausalLM")
