"""SSE-H models. Importing this package registers `sse_hybrid` with transformers' Auto classes."""
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from sse_model.configuration_sse import PRESETS, SSEConfig
from sse_model.modeling_sse import SSEForCausalLM, SSEModel

AutoConfig.register(SSEConfig.model_type, SSEConfig, exist_ok=True)
AutoModel.register(SSEConfig, SSEModel, exist_ok=True)
AutoModelForCausalLM.register(SSEConfig, SSEForCausalLM, exist_ok=True)

__all__ = ["PRESETS", "SSEConfig", "SSEForCausalLM", "SSEModel"]
