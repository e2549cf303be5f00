"""GRPO rollouts: TRL's colocated vLLM generation, adapted to SSE-H on every platform (plugged into TRL by
`pipeline.trl_seams.SSEVLLMGeneration`).

TRL's `VLLMGeneration` is kept (its generate() and the trainer's use of it), with three changes:
- the engine is built with this project's settings (prefix caching off by default: the hybrid block size
  follows the SSE state size, so caching granularity is thousands of tokens; dtype; KV cache size on CPU);
- weights go through vLLM's layerwise reload (`sse_model.vllm.sync.push_weights`, streamed so that a sharded
  trainer gathers them one parameter at a time), not TRL's per-tensor `load_weights`, which goes stale
  silently on the CPU build; after every push a parity probe scores one
  fixed token sequence in vLLM and in the trainer and stops the stage when they drift apart;
- each request gets its own sampling seed derived from (run seed, optimizer step, request index), so a run
  resumed from a checkpoint samples exactly the rollouts an uninterrupted run would have.
"""
from collections.abc import Iterable

import torch

from sse_model.vllm.sync import logprob_parity, push_weights


class WeightSyncDrift(RuntimeError):
    pass


class SeededLLM:
    """A `vllm.LLM` whose generate() seeds every request that has no seed of its own, from `seed_base()`. With
    `record_routes` (an engine that records partition routes, sse_model/vllm/routes.py), `last_routes` holds after
    each generate the routes of each request [positions, SSE layers, K], in the order of its outputs."""

    def __init__(self, llm, seed_base, record_routes: bool = False):
        self._llm, self._seed_base = llm, seed_base
        self.record_routes, self.last_routes = record_routes, None

    def __getattr__(self, name):
        return getattr(self._llm, name)

    def generate(self, prompts, sampling_params=None, **kwargs):
        if sampling_params is not None and not isinstance(sampling_params, list) and sampling_params.seed is None:
            base = self._seed_base()
            sampling_params = [sampling_params.clone() for _ in prompts]
            for i, params in enumerate(sampling_params):
                params.seed = base + i
        outputs = self._llm.generate(prompts, sampling_params, **kwargs)
        if self.record_routes:
            from sse_model.vllm import seams
            self.last_routes = seams.take_routes(self._llm, [o.request_id for o in outputs])
        return outputs


def push_and_check(engine, model, named_tensors: Iterable[tuple[str, torch.Tensor]], parity_ids: list[int],
                   threshold: float) -> float:
    """Push the trainer's weights (`named_tensors`: every parameter of `model`, full, under the HF names, gathered as
    the iterable is consumed) into the engine, then score `parity_ids` in both; the largest logprob difference, or
    WeightSyncDrift when it is over `threshold`. The names and global shapes are `model`'s (a DTensor's shape is
    the full one), checked before the first gather."""
    push_weights(engine, named_tensors, shapes={name: tuple(p.shape) for name, p in model.named_parameters()})
    drift = logprob_parity(engine, model, parity_ids)
    if not drift <= threshold:  # also catches NaN
        raise WeightSyncDrift(
            f"after the weight push, vLLM and the trainer disagree on a fixed sequence by {drift:.4g} in "
            f"logprob (threshold grpo.parity_threshold={threshold}): the rollout engine is not "
            "computing with the trainer's weights or math")
    return drift


def engine_dtype(cfg, settings) -> str:
    """An engine section's dtype (grpo.vllm, eval.vllm), "auto" being model.dtype: the checkpoints are float32
    under model.fp32_master_weights."""
    return cfg.model.dtype if settings.dtype == "auto" else settings.dtype


def records_routes(cfg) -> bool:
    """Whether the rollout engine records partition routes: for replay, or for the route-flip rate."""
    return cfg.grpo.partition_replay or cfg.grpo.route_flip_rate


def engine_kwargs(cfg, model_path: str) -> dict:
    """`vllm.LLM` arguments for the colocated rollout engine."""
    v, g = cfg.grpo.vllm, cfg.grpo
    routes = {"additional_config": {"sse_record_routes": True}} if records_routes(cfg) else {}
    return routes | dict(model=model_path, dtype=engine_dtype(cfg, v), seed=cfg.seed,
                gpu_memory_utilization=v.gpu_memory_utilization,
                max_model_len=g.max_prompt_length + g.trl["max_completion_length"], max_num_seqs=v.max_num_seqs,
                enable_prefix_caching=v.enable_prefix_caching, enforce_eager=v.enforce_eager, tensor_parallel_size=1,
                mamba_ssm_cache_dtype=v.state_dtype, enable_sleep_mode=v.enable_sleep_mode and sleep_supported())


def sleep_supported() -> bool:
    """vLLM's sleep mode unmaps its CUDA memory pool: there is nothing to free on the CPU build."""
    return torch.cuda.is_available()
