"""GRPO rollouts: TRL's colocated vLLM generation, adapted to SSE-H on every platform.

TRL's `VLLMGeneration` is kept (its generate() and the trainer's use of it), with three changes:
- the engine is built with this project's settings (prefix caching off by default: the hybrid block size
  follows the SSE state size, so caching granularity is thousands of tokens; dtype; KV cache size on CPU);
- weights go through `sse_model.vllm_sync.push_weights` (vLLM's layerwise reload), not TRL's per-tensor
  `load_weights`, which goes stale silently on the CPU build; after every push a parity probe scores one
  fixed token sequence in vLLM and in the trainer and stops the stage when they drift apart;
- each request gets its own sampling seed derived from (run seed, optimizer step, request index), so a run
  resumed from a checkpoint samples exactly the rollouts an uninterrupted run would have.
"""
import os

from trl.generation.vllm_generation import VLLMGeneration
from trl.trainer.utils import ensure_master_addr_port

from sse_model.vllm_sync import logprob_parity, push_weights


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


class SSEVLLMGeneration(VLLMGeneration):
    def __init__(self, *, engine_kwargs: dict, seed_base, parity_ids: list[int], parity_threshold: float,
                 on_parity=None, **kwargs):
        self.engine_kwargs, self.seed_base = engine_kwargs, seed_base
        self.parity_ids, self.parity_threshold, self.on_parity = parity_ids, parity_threshold, on_parity
        super().__init__(mode="colocate", **kwargs)

    def _init_vllm(self):
        from vllm import LLM

        # vLLM's external launcher runs the engine in this process, inside the trainer's (possibly
        # single-rank) process group, as TRL's colocate mode does.
        os.environ.setdefault("RANK", str(self.accelerator.process_index))
        os.environ.setdefault("LOCAL_RANK", str(self.accelerator.local_process_index))
        os.environ.setdefault("WORLD_SIZE", str(self.accelerator.num_processes))
        ensure_master_addr_port()
        self.engine = LLM(**self.engine_kwargs, distributed_executor_backend="external_launcher",
                          logprobs_mode="processed_logprobs")
        self.llm = SeededLLM(self.engine, self.seed_base)  # what TRL's generate() uses
        self._llm_weights_sleeping = False
        self.accelerator.wait_for_everyone()

    def sync_weights(self):
        model = self.accelerator.unwrap_model(self.model)
        push_weights(self.engine, model.named_parameters())
        drift = logprob_parity(self.engine, model, self.parity_ids)
        if self.on_parity is not None:
            self.on_parity(drift)
        if not drift <= self.parity_threshold:  # also catches NaN
            raise WeightSyncDrift(
                f"after the weight push, vLLM and the trainer disagree on a fixed sequence by {drift:.4g} in "
                f"logprob (threshold grpo.parity_threshold={self.parity_threshold}): the rollout engine is not "
                "computing with the trainer's weights or math")


def engine_kwargs(cfg, model_path: str) -> dict:
    """`vllm.LLM` arguments for the colocated rollout engine."""
    v, g = cfg.grpo.vllm, cfg.grpo
    if v.kv_cache_gib is not None:
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(v.kv_cache_gib)  # the CPU build sizes its cache from this
    return dict(model=model_path, dtype=v.dtype, seed=cfg.seed, gpu_memory_utilization=v.gpu_memory_utilization,
                max_model_len=g.max_prompt_length + g.trl["max_completion_length"], max_num_seqs=v.max_num_seqs,
                enable_prefix_caching=v.enable_prefix_caching, tensor_parallel_size=1)
