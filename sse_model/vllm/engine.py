"""What an SSE hybrid reads from vLLM's engine config, and the defaults vLLM cannot choose for it by itself
(`verify_and_update_config`, which the plugin registers for every engine of `SSEForCausalLM`).

State dtype, from vLLM's own knob for recurrent states, `mamba_ssm_cache_dtype` (or `mamba_cache_dtype`).
"auto", vLLM's default, lets each model choose (its Mamba2 models take the model's dtype, its KDA layers float32);
an SSE model in bfloat16 or float16 takes int16 states, 16-bit fixed point with a float32 scale per state column
(kernels/sse/decode.py), and a float32 model float32 states. The state bytes a decode step reads and writes are
what bounds its speed: int16 moves half of float32's, and over thousands of decode steps its SSE output stays below
the model's own bfloat16 rounding, with typical gates and long-memory ones (decay close to 1) alike, where bfloat16
states drift well past it (a row whose decay is close to 1 loses every update below half its last bit;
dev/LOG.md has each dtype's measured drift against a float64 cache). "float32" and "bfloat16"
are what they say; float16 is refused (a long-memory row's sum can pass its range).

max_num_seqs.
vLLM runs decode batches in full CUDA graphs, which need one state slot per sequence of `max_num_seqs`, and it
refuses to start when the cache has fewer slots ("max_num_seqs (1024) exceeds available Mamba cache blocks (699)").
Its default `max_num_seqs` suits models with small recurrent states; an SSE layer's float32 state is
4 * H * (N + 1) * c * d_v bytes per sequence, so a 1B-class SSE-H on a GPU holds a few hundred sequences and,
with vLLM's default, does not start. vLLM's own models with such limits lower the default in the same hook.

Model runner.
vLLM runs a hybrid on its V1 GPU model runner unless `VLLM_USE_V2_MODEL_RUNNER` says otherwise; plain
Transformers get the V2 runner, which prepares a step's inputs on the GPU. An SSE-H decode step is bound by host
work, so on a GPU the hook asks for V2 when the user has not chosen (`seams.prefer_v2_model_runner`;
`python -m bench.rollouts` measures rollouts on either runner); `VLLM_USE_V2_MODEL_RUNNER=0` keeps V1. The
colocated GRPO engine (vLLM's external launcher inside the trainer's process, pipeline/trl_seams.py) gets V2 too:
its weight pushes, parity probe and seeded sampling run on V2 (docs/pipeline.md, "On a GPU").
"""
import logging
import os

import torch

from kernels import cache_rows
from sse_model.configuration_sse import SSE_LAYER
from sse_model.vllm import seams
from sse_model.vllm.routes import records_routes

logger = logging.getLogger(__name__)

# The share of vLLM's memory (gpu_memory_utilization of the GPU) assumed to go to activations, CUDA graphs and the
# sampler rather than the cache; the weights are counted exactly. Erring high only lowers max_num_seqs a little
# below what the cache holds, where erring low would leave vLLM refusing to start.
RESERVED_FRACTION = 0.1


STATE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def state_dtype(cache_config, model_dtype: torch.dtype) -> torch.dtype:
    """The SSE state cache's dtype from vLLM's `mamba_ssm_cache_dtype`, else `mamba_cache_dtype`; "auto" is int16
    (fixed point) for a 16-bit model and float32 otherwise."""
    name = cache_config.mamba_ssm_cache_dtype
    if name == "auto":
        name = cache_config.mamba_cache_dtype
    if name == "auto":
        return torch.int16 if model_dtype in (torch.bfloat16, torch.float16) else torch.float32
    if name not in STATE_DTYPES:
        raise ValueError(f"SSE states support mamba_ssm_cache_dtype (or mamba_cache_dtype) auto (int16 fixed point "
                         f"for a 16-bit model, else float32), float32 or bfloat16, got {name!r}")
    return STATE_DTYPES[name]


def state_bytes_per_sequence(config, tp_size: int, dtype: torch.dtype) -> int:
    """SSE states of all SSE layers for one sequence on one tensor-parallel rank."""
    layers = sum(kind == SSE_LAYER for kind in config.layer_types)
    return dtype.itemsize * layers * (config.sse_num_heads // tp_size) * config.num_sse_partitions_with_shared \
        * cache_rows(config.sse_key_dim, dtype) * config.sse_value_dim


def weight_bytes(config, dtype: torch.dtype) -> int:
    from sse_model.modeling_sse import SSEForCausalLM
    with torch.device("meta"):
        return sum(p.numel() for p in SSEForCausalLM(config).parameters()) * dtype.itemsize


def sequences_that_fit(vllm_config, total_memory: int) -> int | None:
    """How many sequences the state cache holds at once, or None where states do not limit it.

    vLLM makes one cache block hold one sequence's SSE states (all its SSE layers) and an attention block the
    same number of bytes, so a running sequence of a hybrid takes at least two blocks."""
    model, cache = vllm_config.model_config, vllm_config.cache_config
    config, tp = model.hf_config, vllm_config.parallel_config.tensor_parallel_size
    state = state_bytes_per_sequence(config, tp, state_dtype(cache, model.dtype))
    if not state:
        return None
    if cache.num_gpu_blocks_override:
        blocks = cache.num_gpu_blocks_override
    else:
        budget = cache.kv_cache_memory_bytes or int(total_memory * cache.gpu_memory_utilization
                                                    * (1 - RESERVED_FRACTION) - weight_bytes(config, model.dtype) / tp)
        blocks = budget // state
    blocks_per_sequence = 2 if any(kind != SSE_LAYER for kind in config.layer_types) else 1
    return max(1, blocks // blocks_per_sequence)


def verify_and_update_config(vllm_config) -> None:
    """vLLM's per-architecture config hook (`seams.register_engine_config`): on a GPU, the V2 model runner unless
    the user chose one, and `max_num_seqs` lowered to the sequences whose states fit in the cache."""
    from vllm.platforms import current_platform
    if not current_platform.is_cuda_alike():  # the CPU build runs no CUDA graphs and sizes its cache itself
        return
    if records_routes(vllm_config):  # the runner hook that files routes per request is the V1 runner's
        os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
        logger.info("SSE-H: route recording runs on vLLM's V1 model runner")
    elif seams.prefer_v2_model_runner():
        logger.info("SSE-H: vLLM's V2 model runner (VLLM_USE_V2_MODEL_RUNNER=0 keeps V1)")
    fit = sequences_that_fit(vllm_config, current_platform.get_device_total_memory())
    scheduler = vllm_config.scheduler_config
    if fit is not None and scheduler.max_num_seqs > fit:
        logger.warning("SSE-H: max_num_seqs lowered from %d to %d, the sequences whose SSE states fit in the "
                       "cache (pass max_num_seqs, gpu_memory_utilization or kv_cache_memory_bytes to choose)",
                       scheduler.max_num_seqs, fit)
        scheduler.max_num_seqs = fit
