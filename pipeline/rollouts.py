"""GRPO rollouts: TRL's colocated vLLM generation, adapted to SSE-H on every platform (plugged into TRL by
`pipeline.trl_seams.SSEVLLMGeneration`).

TRL's `VLLMGeneration` is kept (its generate() and the trainer's use of it), with three changes:
- the engine is built with this project's settings (prefix caching off by default: the hybrid block size
  follows the SSE state size, so caching granularity is thousands of tokens; dtype; KV cache size on CPU);
- weights go through vLLM's layerwise reload (as `sse_model.vllm_sync.push_weights` does, streamed here so that a
  sharded trainer gathers them one parameter at a time), not TRL's per-tensor `load_weights`, which goes stale
  silently on the CPU build; after every push a parity probe scores one
  fixed token sequence in vLLM and in the trainer and stops the stage when they drift apart;
- each request gets its own sampling seed derived from (run seed, optimizer step, request index), so a run
  resumed from a checkpoint samples exactly the rollouts an uninterrupted run would have.
"""
from collections.abc import Iterable

import torch

from sse_model.vllm_sync import expected_shapes, logprob_parity


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


def push_streamed(engine, model, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Load `model`'s weights into `engine` (no request in flight) through vLLM's layerwise reload, taking
    `named_tensors` (every parameter of `model`, full, under the HF names) as the iterable yields them: vLLM
    processes a layer once its tensors have arrived and drops them, so a sharded trainer that gathers a parameter
    per step of the iterable never holds the whole model gathered. The names and global shapes of `model`'s
    parameters (a DTensor's shape is the full one) are checked first, before any collective: a push that failed
    half way would leave the engine half loaded and the other ranks waiting in a gather."""
    config = engine.llm_engine.model_config.hf_config
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    want = expected_shapes(config)
    if shapes != want:
        raise ValueError(f"the trainer's parameters are not the engine's model: missing "
                         f"{sorted(want.keys() - shapes.keys())}, unknown {sorted(shapes.keys() - want.keys())}, "
                         f"wrong shape {sorted(n for n in shapes.keys() & want.keys() if shapes[n] != want[n])}")
    # The engine runs in this process (external launcher): the iterable reaches vLLM's loader unpickled.
    engine.collective_rpc("reload_weights", kwargs=dict(
        weights_iterator=((name, tensor.detach()) for name, tensor in named_tensors), is_checkpoint_format=True))
    if not engine.reset_prefix_cache():
        raise RuntimeError("vLLM could not reset its prefix cache after the weight push (requests still running?); "
                           "cached KV and SSE states from the old weights would be reused")


def push_and_check(engine, model, named_tensors: Iterable[tuple[str, torch.Tensor]], parity_ids: list[int],
                   threshold: float) -> float:
    """Push the trainer's weights (`named_tensors`, see `push_streamed`) into the engine, then score `parity_ids`
    in both; the largest logprob difference, or WeightSyncDrift when it is over `threshold`."""
    push_streamed(engine, model, named_tensors)
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


def engine_kwargs(cfg, model_path: str) -> dict:
    """`vllm.LLM` arguments for the colocated rollout engine."""
    v, g = cfg.grpo.vllm, cfg.grpo
    return dict(model=model_path, dtype=engine_dtype(cfg, v), seed=cfg.seed,
                gpu_memory_utilization=v.gpu_memory_utilization,
                max_model_len=g.max_prompt_length + g.trl["max_completion_length"], max_num_seqs=v.max_num_seqs,
                enable_prefix_caching=v.enable_prefix_caching, enforce_eager=v.enforce_eager, tensor_parallel_size=1,
                mamba_ssm_cache_dtype=v.state_dtype)
