"""Stage `grpo`: TRL's GRPOTrainer with rollouts from the colocated vLLM engine running the SSE-H plugin,
rewards from the registry, optional evaluation every `grpo.eval_every` steps. Resumes from the stage's last
complete checkpoint (model, optimizer, scheduler, RNG, data position, step)."""
from pathlib import Path

from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from trl import GRPOConfig, GRPOTrainer

import rewards
import sse_model  # noqa: F401  (registers sse_hybrid with the Auto classes)
from eval.engine import set_cpu_kv_cache
from pipeline.config import eval_datasets
from pipeline.faults import fault_point
from pipeline.rollouts import engine_kwargs
from pipeline.training import (
    StageCallback,
    common_training_args,
    resume_checkpoint,
    save_final_model,
    weights_dtype,
)
from pipeline.trl_seams import (
    AtomicCheckpointsMixin,
    BalanceLossMixin,
    ExactStepsOnResumeMixin,
    OwnRolloutEngineMixin,
    ShardedStateMixin,
    mark_weights_loaded,
    set_logprob_chunks,
)
from tasks.loaders import filter_long_prompts, load_rl_dataset
from tasks.prompts import prompt_token_ids


class SSEGRPOTrainer(AtomicCheckpointsMixin, ExactStepsOnResumeMixin, BalanceLossMixin, OwnRolloutEngineMixin,
                     ShardedStateMixin, GRPOTrainer):
    """GRPOTrainer whose rollouts come from the pipeline's colocated vLLM engine (pipeline/trl_seams.py)."""

    stage = "grpo"

    def rollout_seed_base(self) -> int:
        # Called once per generate() of a training rollout. Distinct for every (seed, step, rank): each rank's
        # engine samples its own share of a prompt's copies. Request i gets base + i.
        fault_point("grpo.rollout", self.state.global_step + 1, Path(self.args.output_dir).parent)
        step_seed = (self.args.seed * 1_000_003 + self.state.global_step) * 1024 + self.accelerator.process_index
        return step_seed % 2**40 * 65_536  # below 2**56: torch generators take 64-bit seeds


class PeriodicEval(TrainerCallback):
    """Every `every` steps, every rank pushes the current weights into its colocated engine and draws its share of
    the eval stage's datasets (eval/runner.py, `ranks`), as verl validates on all its rollout workers: no rank waits
    for another's whole evaluation, and under `trainer.sharding: fsdp` every rank takes part in the weight gather.
    Rank 0 merges and logs the scores."""

    def __init__(self, cfg, run_dir, every: int):
        self.cfg, self.run_dir, self.every, self.trainer = cfg, run_dir, every, None

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step % self.every:
            return
        from eval.runner import evaluate

        generation = self.trainer.vllm_generation
        generation.sync_weights()
        mark_weights_loaded(self.trainer, state.global_step)
        e = self.cfg.eval
        results = evaluate(generation.llm, eval_datasets(self.cfg), self.run_dir.stage_dir("grpo") /
                           f"eval-step-{state.global_step}", n=e.n, temperature=e.temperature, top_p=e.top_p,
                           max_tokens=e.max_tokens, seed=self.cfg.seed, limit=e.limit,
                           ranks=self.trainer.accelerator.num_processes > 1)
        if state.is_world_process_zero:
            self.run_dir.log_metrics("grpo", state.global_step, {
                f"eval/{name}/{key}": m[key] for name, m in results.items()
                for key in (f"avg@{e.n}", "skipped_problems") if key in m})


def run(cfg, run_dir, model_path) -> dict:
    g = cfg.grpo
    out = run_dir.stage_dir("grpo")
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=weights_dtype(cfg))
    dataset, skipped = filter_long_prompts(load_rl_dataset(cfg.data.grpo), tokenizer, g.max_prompt_length,
                                           g.long_prompts)
    resume = resume_checkpoint(run_dir, "grpo")
    if resume is None:  # a resumed stage keeps the row its first attempt logged
        run_dir.log_metrics("grpo", 0, {"prompts": len(dataset), "prompts_skipped_too_long": skipped})
    limit = g.reward_failure and rewards.FailureLimit(g.reward_failure.max_share, g.reward_failure.steps)
    funcs, weights = rewards.build_rewards(g.rewards, failure_limit=limit)
    set_logprob_chunks(cfg.trainer.logprob_chunk_tokens, cfg.trainer.logprob_chunk_vocab)
    args = GRPOConfig(**common_training_args(cfg, g, out), max_steps=g.steps, reward_weights=weights)
    parity_ids = prompt_token_ids(tokenizer, dataset[0]["prompt"]) + tokenizer.encode(
        f"\\boxed{{{dataset[0]['answer']}}}", add_special_tokens=False)
    callbacks = [StageCallback(run_dir, "grpo", model)]
    if g.eval_every:
        callbacks.append(PeriodicEval(cfg, run_dir, g.eval_every))
    set_cpu_kv_cache(g.vllm)
    trainer = SSEGRPOTrainer(model=model, reward_funcs=funcs, args=args, train_dataset=dataset,
                             processing_class=tokenizer, callbacks=callbacks,
                             engine=engine_kwargs(cfg, model_path), parity_ids=parity_ids,
                             parity_threshold=g.parity_threshold, partition_replay=g.partition_replay,
                             route_flip_rate=g.route_flip_rate)
    for callback in callbacks:
        if isinstance(callback, PeriodicEval):
            callback.trainer = trainer
    trainer.train(resume_from_checkpoint=str(resume) if resume else None)
    final = save_final_model(trainer, tokenizer, out / "final")
    failures = rewards.failure_counts()
    return {"output": str(final), "steps": trainer.state.global_step, "reward_failures": failures,
            "summary": f"{trainer.state.global_step} steps" + (f" (resumed from {resume.name})" if resume else "")
                       + (f", reward failures {failures}" if any(sum(v.values()) for v in failures.values()) else "")}
