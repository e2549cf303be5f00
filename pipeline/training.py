"""What the SFT and GRPO stages share on top of the Hugging Face / TRL trainers, through their public API (what
overrides their internals is in pipeline/trl_seams.py).

- `StageCallback`: metrics into the run's metrics.jsonl, progress for the driver's console.
- `resume_checkpoint`, `save_final_model`, `common_training_args` (with `sharding_args`), `weights_dtype`.
"""
import math
import os
import shutil
import socket
from pathlib import Path

import torch
from transformers import TrainerCallback

from pipeline.faults import fault_point
from pipeline.partition_routes import partition_set_counts, routing_health
from pipeline.rundir import CHECKPOINT, RunDir, latest_checkpoint
from sse_model.hub_code import save_model_code
from tasks.files import replace_dir


class StageCallback(TrainerCallback):
    """Writes the trainer's logs into the run's metrics.jsonl (one line per log event), with the SSE routing
    statistics of the training forward passes since the last log: per SSE layer the partition usage, its entropy
    and the share of the most used set of partitions (`routing/usage_entropy/<layer>`,
    `routing/modal_set_share/<layer>`), and the balance loss; and the stage's progress (step, total, which attempt,
    from which checkpoint) for the driver's console."""

    def __init__(self, run: RunDir, stage: str, model=None):
        self.run, self.stage = run, stage
        self._attempt = {}
        self._usage, self._balance, self._sets, self._count = 0.0, 0.0, 0, 0
        if model is not None:  # the backbone: TRL's fused LM head calls it directly, bypassing the model's forward
            model.base_model.register_forward_hook(self._record_routing, with_kwargs=True)

    def _record_routing(self, module, args, kwargs, output):
        usage = getattr(output, "partition_usage", None)
        if usage is None or not torch.is_grad_enabled():  # count training forwards only, not no-grad scoring
            return
        # Summed on the device and read once per log: a host read per forward would stall a step the host bounds
        self._usage = self._usage + usage.detach().float()
        self._balance = self._balance + output.balance_loss.detach().float()
        self._sets = self._sets + partition_set_counts(output.partition_choices, module.config.sse_num_partitions,
                                                       kwargs.get("attention_mask"))
        self._count += 1

    def on_train_begin(self, args, state, control, **kwargs):
        # The trainer state is already restored here: global_step is the checkpoint's.
        self._attempt = {"attempt": f"{os.getpid()}@{socket.gethostname()}",
                         "resumed_from": f"checkpoint-{state.global_step}" if state.global_step else None}
        self._write_progress(state)

    def on_step_end(self, args, state, control, **kwargs):
        self._write_progress(state)

    def _write_progress(self, state):
        if state.is_world_process_zero:
            self.run.write_progress(self.stage, done=state.global_step, total=state.max_steps, unit="step",
                                    **self._attempt)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not (state.is_world_process_zero and logs):
            return
        clean = {k: v for k, v in logs.items() if isinstance(v, (int, float)) and math.isfinite(v)}
        clean.update(gpu_memory() | update_time(clean))
        if self._count:
            usage = (self._usage / self._count).cpu()
            clean["balance_loss"] = float(self._balance) / self._count
            clean.update(routing_health(usage, self._sets.cpu()))
            for layer, row in enumerate(usage.tolist()):
                clean.update({f"partition_usage/{layer}/{p}": round(u, 4) for p, u in enumerate(row)})
            self._usage, self._balance, self._sets, self._count = 0.0, 0.0, 0, 0
        self.run.log_metrics(self.stage, state.global_step, clean)


def gpu_memory() -> dict:
    """Peak GPU memory allocated by this process since the last log (GiB): on one GPU the trainer's and the colocated
    vLLM engine's together (vLLM allocates its cache through torch). Empty without CUDA."""
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return {}
    peak = torch.cuda.max_memory_allocated() / 2**30
    torch.cuda.reset_peak_memory_stats()
    return {"gpu_memory/peak_allocated_gib": peak, "gpu_memory/reserved_gib": torch.cuda.memory_reserved() / 2**30}


def update_time(logs: dict) -> dict:
    """GRPO: the part of TRL's `step_time` (the step's training_step calls) left after the rollout, the scoring, the
    wait for the other ranks before it and the weight push: the policy's forward and backward passes, TRL's
    log-probability passes included (and on several ranks, DDP's gradient all-reduce)."""
    phases = ("time/rollout_s", "time/scoring_s", "time/weight_push_s", "time/rank_wait_s")
    if "step_time" not in logs or not all(p in logs for p in phases[:2]):
        return {}
    return {"time/update_s": logs["step_time"] - sum(logs.get(p, 0.0) for p in phases)}


def resume_checkpoint(run: RunDir, stage: str) -> Path | None:
    """The stage's last complete checkpoint (None: start from the beginning), after forgetting the metrics an
    earlier attempt logged past it: they will be logged again. Call before the stage logs anything."""
    checkpoint = latest_checkpoint(run.stage_dir(stage))
    step = int(CHECKPOINT.match(checkpoint.name).group(1)) if checkpoint else -1  # -1: all of the stage's rows
    # One writer for metrics.jsonl: every worker of a multi-worker stage gets here, only rank 0 logs.
    if not (torch.distributed.is_initialized() and torch.distributed.get_rank() != 0):
        run.drop_metrics_after(stage, step)
        if checkpoint:
            print(f"[{stage}] resuming from {checkpoint}", flush=True)  # the console (and tests) see where from
    return checkpoint


def save_final_model(trainer, tokenizer, out: Path) -> Path:
    """`out` appears only complete: written beside it, then renamed. With several ranks only the main process
    touches the directories (each rank renaming its own copy lost the model), and every rank returns once it
    is there."""
    staging = out.with_name(f".partial-{out.name}")
    main = trainer.accelerator.is_main_process
    if main:
        shutil.rmtree(staging, ignore_errors=True)
    trainer.accelerator.wait_for_everyone()
    trainer.save_model(str(staging))  # on every rank: sharded weights are gathered; the main process writes
    if main:
        save_model_code(staging)
        tokenizer.save_pretrained(str(staging))
        replace_dir(staging, out)
        fault_point(f"{trainer.stage}.end", trainer.state.global_step, out.parent.parent)
    trainer.accelerator.wait_for_everyone()
    return out


def weights_dtype(cfg) -> torch.dtype:
    """The dtype of the weights a trainer updates: model.dtype, or float32 under model.fp32_master_weights (then
    the bf16 of model.dtype is the autocast of TrainingArguments.bf16)."""
    return torch.float32 if cfg.model.fp32_master_weights else getattr(torch, cfg.model.dtype)


def common_training_args(cfg, stage_cfg, out: Path) -> dict:
    """TrainingArguments shared by SFT and GRPO: what the pipeline sets (`pipeline.config.SET_BY_PIPELINE`), the
    section's own keys under TRL's names, then the section's TRL settings as the config gives them."""
    on_gpu = torch.cuda.is_available()
    return dict(
        output_dir=str(out),
        seed=cfg.seed,
        data_seed=cfg.seed,
        bf16=cfg.model.dtype == "bfloat16" and on_gpu,
        use_cpu=not on_gpu,
        report_to=list(stage_cfg.report_to),  # beside metrics.jsonl (StageCallback), which is always written
        save_strategy="steps",
        save_only_model=False,
        dataloader_num_workers=0,
        disable_tqdm=True,
        per_device_train_batch_size=stage_cfg.per_device_batch_size,
        lr_scheduler_type=stage_cfg.lr_scheduler,
        warmup_steps=stage_cfg.warmup_ratio,  # transformers 5 takes a ratio here when < 1
        **sharding_args(cfg),
        **stage_cfg.trl,
    )


def sharding_args(cfg) -> dict:
    """TrainingArguments for `trainer.sharding`. "fsdp": FSDP2 through accelerate, each decoder layer (the model's
    `_no_split_modules`) a unit of its own, gathered for its forward and backward and resharded after, so a rank
    holds its 1/N of the float32 weights, gradients and Adam state plus one layer in full; the embeddings, the head
    and the final norm form the root unit. Checkpoints stay full state dicts (written by rank 0), so a run resumes
    and exports as an unsharded one does. On CPU, `pipeline.trl_seams.ShardedStateMixin` lets accelerate take it."""
    if cfg.trainer.sharding == "none":
        return {}
    return dict(fsdp=True, fsdp_config={"version": 2, "reshard_after_forward": True,
                                                "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
                                                "state_dict_type": "FULL_STATE_DICT"})
