"""What the SFT and GRPO stages share on top of the Hugging Face / TRL trainers.

- `AtomicCheckpointsMixin`: checkpoints are written under a hidden name and renamed into place when complete.
- `BalanceLossMixin`: adds the SSE partition-balance loss, which TRL's own losses leave out.
- `StageCallback`: metrics into the run's metrics.jsonl.
- `NonFiniteLoss`: a NaN/inf loss stops the stage before the optimizer step, so no bad weights are ever saved.
- `CheckpointWriteError`: a checkpoint that cannot be written (disk full) stops the stage, naming it and the last
  complete checkpoint, which stays.
- `resume_checkpoint`, `save_final_model`, `common_training_args`.
"""
import math
import os
import shutil
from pathlib import Path

import torch
from transformers import TrainerCallback
from transformers.trainer_utils import rotate_checkpoints

from pipeline.faults import fault_point
from pipeline.rundir import CHECKPOINT, RunDir, fsync_dir, latest_checkpoint


class NonFiniteLoss(RuntimeError):
    pass


class CheckpointWriteError(RuntimeError):
    pass


class AtomicCheckpointsMixin:
    """Mix in before a `transformers.Trainer` subclass.

    The trainer writes `checkpoint-<step>` straight into the output directory; a kill mid-write would leave a
    directory that looks complete. Here it writes into `.partial-checkpoint-<step>/` and renames when done, and
    `training_step` refuses a non-finite loss before it reaches the optimizer. `stage` names the pipeline stage
    (for fault points)."""

    _staging_dir = None
    stage = "train"

    def _get_output_dir(self, trial):
        return self._staging_dir or super()._get_output_dir(trial)

    def _save_checkpoint(self, model, trial):
        run_dir = Path(super()._get_output_dir(trial))
        name = f"checkpoint-{self.state.global_step}"
        staging = run_dir / f".partial-{name}"
        shutil.rmtree(staging, ignore_errors=True)
        self._staging_dir = str(staging)
        try:
            try:
                super()._save_checkpoint(model, trial)
            finally:
                self._staging_dir = None
            fault_point(f"{self.stage}.checkpoint_write", self.state.global_step, Path(self.args.output_dir).parent)
            if self.args.should_save:
                for file in (staging / name).iterdir():
                    with open(file, "rb") as f:
                        os.fsync(f.fileno())  # a full disk may only show here (delayed allocation)
        except OSError as err:  # disk full, quota, I/O error: say which checkpoint and what is still there
            shutil.rmtree(staging, ignore_errors=True)  # a partial checkpoint is never used; give its space back
            last = latest_checkpoint(run_dir)
            raise CheckpointWriteError(
                f"{name} could not be written to {staging}: {err}; the partial checkpoint was removed and the "
                f"last complete one, {last.name if last else 'none yet'}, is kept") from err
        if self.args.should_save:
            shutil.rmtree(run_dir / name, ignore_errors=True)
            os.rename(staging / name, run_dir / name)
            staging.rmdir()
            fsync_dir(run_dir)
            rotate_checkpoints(output_dir=str(run_dir), save_total_limit=self.args.save_total_limit, use_mtime=False)

    def training_step(self, model, inputs, num_items_in_batch=None):
        loss = super().training_step(model, inputs, num_items_in_batch)
        fault_point(f"{self.stage}.step", self.state.global_step + 1, Path(self.args.output_dir).parent)
        if not torch.isfinite(loss).all():
            last = latest_checkpoint(Path(self.args.output_dir))
            raise NonFiniteLoss(f"loss is {loss.item()} at step {self.state.global_step + 1}; the stage stops here "
                                f"and the last good checkpoint, {last.name if last else 'none yet'}, is kept")
        return loss


class BalanceLossMixin:
    """TRL computes its losses from log-probabilities (SFT through a fused LM head that calls the backbone
    directly), so the model's own loss, which adds the SSE balance term, is never used. The backbone returns the
    balance loss; it is added here with the model's coefficient."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        captured = []
        hook = self.model.base_model.register_forward_hook(lambda m, a, out: captured.append(out.balance_loss))
        try:
            result = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        finally:
            hook.remove()
        coef = self.model.config.sse_balance_loss_coef
        balance = next((b for b in captured if b is not None and b.requires_grad), None)
        if coef and balance is not None:
            # A per-micro-batch mean: scale it like the trainer scales the loss over gradient accumulation (the
            # Trainer divides by the accumulation steps unless the loss was normalised by num_items_in_batch).
            trainer_divides = (not self.model_accepts_loss_kwargs or num_items_in_batch is None) \
                and self.compute_loss_func is None
            extra = coef * balance / (1 if trainer_divides else self.current_gradient_accumulation_steps)
            result = (result[0] + extra, result[1]) if return_outputs else result + extra
        return result


class StageCallback(TrainerCallback):
    """Writes the trainer's logs into the run's metrics.jsonl (one line per log event), with the SSE routing
    statistics of the forward passes since the last log: partition usage per SSE layer and the balance loss."""

    def __init__(self, run: RunDir, stage: str, model=None):
        self.run, self.stage = run, stage
        self._usage, self._balance, self._count = 0.0, 0.0, 0
        if model is not None:  # the backbone: TRL's fused LM head calls it directly, bypassing the model's forward
            model.base_model.register_forward_hook(self._record_routing)

    def _record_routing(self, module, args, output):
        usage = getattr(output, "partition_usage", None)
        if usage is None or not torch.is_grad_enabled():  # count training forwards only, not no-grad scoring
            return
        self._usage = self._usage + usage.detach().float().cpu()
        self._balance += float(output.balance_loss.detach())
        self._count += 1

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not (state.is_world_process_zero and logs):
            return
        clean = {k: v for k, v in logs.items() if isinstance(v, (int, float)) and math.isfinite(v)}
        if self._count:
            clean["balance_loss"] = self._balance / self._count
            for layer, row in enumerate((self._usage / self._count).tolist()):
                clean.update({f"partition_usage/{layer}/{p}": round(u, 4) for p, u in enumerate(row)})
            self._usage, self._balance, self._count = 0.0, 0.0, 0
        self.run.log_metrics(self.stage, state.global_step, clean)


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
        tokenizer.save_pretrained(str(staging))
        shutil.rmtree(out, ignore_errors=True)
        os.rename(staging, out)
        fsync_dir(out.parent)
    trainer.accelerator.wait_for_everyone()
    return out


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
        report_to=[],
        save_strategy="steps",
        save_only_model=False,
        dataloader_num_workers=0,
        disable_tqdm=True,
        per_device_train_batch_size=stage_cfg.per_device_batch_size,
        lr_scheduler_type=stage_cfg.lr_scheduler,
        warmup_steps=stage_cfg.warmup_ratio,  # transformers 5 takes a ratio here when < 1
        **stage_cfg.trl,
    )
