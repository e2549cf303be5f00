"""GRPO rollouts: TRL's colocated vLLM generation, adapted to SSE-H on every platform (plugged into TRL by
`pipeline.trl_seams.SSEVLLMGeneration`).

TRL's `VLLMGeneration` is kept (its generate() and the trainer's use of it), with three changes:
- the engine is built with this project's settings (prefix caching off by default: the hybrid block size
  follows the SSE state size, so caching granularity is thousands of tokens; dtype; KV cache size on CPU);
- weights go through `sse_model.vllm.sync.push_weights` (vLLM's layerwise reload), not TRL's per-tensor
  `load_weights`, which goes stale silently on the CPU build; after every push a parity probe scores one
  fixed token sequence in vLLM and in the trainer and stops the stage when they drift apart;
- each request gets its own sampling seed derived from (run seed, optimizer step, request index), so a run
  resumed from a checkpoint samples exactly the rollouts an uninterrupted run would have.
"""
import os

from sse_model.vllm.sync import logprob_parity, push_weights


class WeightSyncDrift(RuntimeError):
    pass


class SeededLLM:
    """A `vllm.LLM` whose generate() seeds every request that has no seed of its own, from `seed_base()`."""

    def __init__(self, llm, seed_base):
        self._llm, self._seed_base = llm, seed_base

    def __getattr__(self, name):
        return getattr(self._llm, name)

    def generate(self, prompts, sampling_params=None, **kwargs):
        if sampling_params is not None and not isinstance(sampling_params, list) and sampling_params.seed is None:
            base = self._seed_base()
            sampling_params = [sampling_params.clone() for _ in prompts]
            for i, params in enumerate(sampling_params):
                params.seed = base + i
        return self._llm.generate(prompts, sampling_params, **kwargs)


def push_and_check(engine, model, parity_ids: list[int], threshold: float) -> float:
    """Push the trainer's weights into the engine, then score `parity_ids` in both; the largest logprob
    difference, or WeightSyncDrift when it is over `threshold`."""
    push_weights(engine, model.named_parameters())
    drift = logprob_parity(engine, model, parity_ids)
    if not drift <= threshold:  # also catches NaN
        raise WeightSyncDrift(
            f"after the weight push, vLLM and the trainer disagree on a fixed sequence by {drift:.4g} in "
            f"logprob (threshold grpo.parity_threshold={threshold}): the rollout engine is not "
            "computing with the trainer's weights or math")
    return drift


def set_cpu_kv_cache(v) -> None:
    """Before an engine starts in this process: the CPU build sizes its KV cache from VLLM_CPU_KVCACHE_SPACE (GiB),
    not from an LLM argument, so `grpo.vllm.kv_cache_gib` goes into the environment."""
    if v.kv_cache_gib is not None:
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(v.kv_cache_gib)


def engine_dtype(cfg) -> str:
    """grpo.vllm.dtype, "auto" being model.dtype: the checkpoints are float32 under model.fp32_master_weights."""
    return cfg.model.dtype if cfg.grpo.vllm.dtype == "auto" else cfg.grpo.vllm.dtype


def engine_kwargs(cfg, model_path: str) -> dict:
    """`vllm.LLM` arguments for the colocated rollout engine."""
    v, g = cfg.grpo.vllm, cfg.grpo
    return dict(model=model_path, dtype=engine_dtype(cfg), seed=cfg.seed,
                gpu_memory_utilization=v.gpu_memory_utilization,
                max_model_len=g.max_prompt_length + g.trl["max_completion_length"], max_num_seqs=v.max_num_seqs,
                enable_prefix_caching=v.enable_prefix_caching, enforce_eager=v.enforce_eager, tensor_parallel_size=1,
                mamba_ssm_cache_dtype=v.state_dtype)
