"""What an SSE hybrid reads from vLLM's engine config, and the defaults vLLM cannot choose for it by itself.

State dtype, from vLLM's own knob for recurrent states, `mamba_ssm_cache_dtype` (or `mamba_cache_dtype`).
"auto", vLLM's default, lets each model choose (its Mamba2 models take the model's dtype, its KDA layers float32);
an SSE model in bfloat16 or float16 takes int16 states, 16-bit fixed point with a float32 scale per state column
(kernels/sse/decode.py), and a float32 model float32 states. The state bytes a decode step reads and writes are
what bounds its speed: int16 moves half of float32's, and over 4k decode steps its SSE output stays within 3e-4 of
a float64 cache's with typical gates and 6e-4 with long-memory ones (decay ~0.999), below the model's own bfloat16
rounding (4e-3), where bfloat16 states are off by 0.5 % and 8-14 % (a row whose decay is close to 1 loses every
update below half its last bit) and float32 by under 1e-6 (bench/state_dtype_drift.py). "float32" and "bfloat16"
are what they say; float16 is refused (a long-memory row's sum can pass its range).

max_num_seqs.
vLLM runs decode batches in full CUDA graphs, which need one state slot per sequence of `max_num_seqs`, and it
refuses to start when the cache has fewer slots ("max_num_seqs (1024) exceeds available Mamba cache blocks (699)").
Its default `max_num_seqs` (1024 on an H100) suits models with small recurrent states; an SSE layer's float32 state
is 4 * H * (N + 1) * c * d_v bytes per sequence (5 MiB at H = 16, N = 4, c = d_v = 128), so a 1B-class SSE-H on an
80 GB GPU holds a few hundred sequences and, with the default, does not start. vLLM's own models with such limits
lower the default in the same hook (`vllm.model_executor.models.config.MODELS_CONFIG_MAP`).

Model runner.
vLLM 0.25 runs a hybrid on its V1 GPU model runner unless `VLLM_USE_V2_MODEL_RUNNER` says otherwise; plain
Transformers get the V2 runner, which prepares a step's inputs on the GPU. A 1.5B SSE-H decode step is host-bound
(~7.4 ms of GPU work at batch 256 on an H200), and V2 took it from 12.3 to 10.3 ms of wall time in an in-process
engine and 1k rollouts 4 % faster in vLLM's default one (bench/results/vllm_v2_runner_20261128.md), so on a GPU
the hook sets `VLLM_USE_V2_MODEL_RUNNER=1` when the user has not set it. vLLM reads it from the environment (this
process and the engine processes it starts after this hook), so it holds for later engines of this process too;
`VLLM_USE_V2_MODEL_RUNNER=0` keeps V1. The colocated GRPO engine (vLLM's external launcher inside the trainer's
process, pipeline/trl_seams.py) gets V2 too: its weight pushes, parity probe and seeded sampling ran on V2 on an
H200 (docs/pipeline.md, "On a GPU").
"""
import logging
import os

import torch
from vllm.model_executor.models.config import VerifyAndUpdateConfig

from kernels import cache_rows
from sse_model.configuration_sse import SSE_LAYER

logger = logging.getLogger(__name__)

# The share of vLLM's memory (gpu_memory_utilization of the GPU) assumed to go to activations, CUDA graphs and the
# sampler rather than the cache; the weights are counted exactly. Erring high only lowers max_num_seqs further
# below what the cache holds (on an H100, 1.5B SSE-H: 323 sequences estimated, 350 held).
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


class SSEEngineConfig(VerifyAndUpdateConfig):
    @classmethod
    def verify_and_update_config(cls, vllm_config) -> None:
        from vllm.platforms import current_platform
        if not current_platform.is_cuda_alike():  # the CPU build runs no CUDA graphs and sizes its cache itself
            return
        if "VLLM_USE_V2_MODEL_RUNNER" not in os.environ:
            os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"
            logger.info("SSE-H: vLLM's V2 model runner (VLLM_USE_V2_MODEL_RUNNER=0 keeps V1)")
        fit = sequences_that_fit(vllm_config, current_platform.get_device_total_memory())
        scheduler = vllm_config.scheduler_config
        if fit is not None and scheduler.max_num_seqs > fit:
            logger.warning("SSE-H: max_num_seqs lowered from %d to %d, the sequences whose SSE states fit in the "
                           "cache (pass max_num_seqs, gpu_memory_utilization or kv_cache_memory_bytes to choose)",
                           scheduler.max_num_seqs, fit)
            scheduler.max_num_seqs = fit
