"""Every place the pipeline reaches into TRL's or the Hugging Face Trainer's internals: overridden methods,
private attributes, and behaviour neither library documents as API. tests/test_trl_seams.py has a test per
seam that fails when the installed TRL or transformers changes what it relies on; after upgrading either,
run it first.

Seams (stage in brackets), and what each relies on:
- `AtomicCheckpointsMixin` [sft, grpo]: `Trainer._save_checkpoint(model, trial)` writes `checkpoint-<step>` under
  `self._get_output_dir(trial)`; `training_step` returns the loss before the optimizer step.
- `ExactStepsOnResumeMixin` [sft, grpo]: `Trainer._init_training_state(max_steps, num_update_steps_per_epoch,
  num_train_epochs, resume_from_checkpoint, trial)` restores the checkpoint's state and returns `(epochs_trained,
  steps_trained_in_current_epoch)`; the training loop runs the epochs from `epochs_trained` to `num_train_epochs`
  and checks `max_steps` only after a step.
- `BalanceLossMixin` [sft, grpo]: `compute_loss`'s signature; TRL's losses call the backbone (`model.base_model`),
  not the model's forward; `model_accepts_loss_kwargs`, `compute_loss_func` and
  `current_gradient_accumulation_steps` decide whether the Trainer divides the loss.
- `TokenCountInStateMixin` [sft]: `SFTTrainer` counts the tokens it logs in `self._total_train_tokens`, which
  checkpoints do not keep.
- `TokenWeightedLossMixin` [sft, only with `sft.token_weights`]: `SFTTrainer.compute_loss` takes its loss as
  `-outputs.log_probs` summed over the batch, from the fused LM head's output of the top-level model's forward, whose
  `log_probs[:, p]` is the term of input position p; the prepared `train_dataset` has `input_ids` and `labels`;
  the Trainer keeps only the dataset columns in `_signature_columns` (`_set_signature_columns_if_needed`); TRL's
  collator (`data_collator`, attribute `padding_free`) pads on the right and ignores other columns.
- `OwnRolloutEngineMixin` [grpo]: `GRPOTrainer` builds its `VLLMGeneration` in `__init__` only when
  `args.use_vllm`, and at generation reads `self.use_vllm`, `self.vllm_generation` and `self._last_loaded_step`;
  its sampling attributes (`temperature`, `top_p`, ...); it scores a generation batch with one
  `_calculate_rewards(inputs, prompts, completions, completion_ids_list)` call on every rank (timed as
  `time/scoring_s`; on several ranks the wait for the others before it as `time/rank_wait_s`);
  `_generate_and_score_completions(inputs)` returns `completion_mask`, and with vLLM importance sampling on
  `old_per_token_logps` (the trainer's) and `sampling_per_token_logps` (vLLM's) for the sampled tokens (their
  KL, `sampling/kl_rollout_trainer`, computed by `rollout_kl`). With partition routes recorded
  (`grpo.partition_replay`, `grpo.route_flip_rate`): the dict it returns goes through TRL's shuffle and split of
  the generation batch (`shuffle_sequence_dict`, `split_tensor_dict`: every tensor along its first dimension), so
  a `partition_routes` tensor added to it reaches `compute_loss(model, inputs, ...)` with its rows; the
  log-probability passes (`_get_per_token_logps_and_entropies`) call the backbone on slices of the batch in order
  (`pipeline.partition_routes.RouteFeed`); a prompt is left-padded and its completion follows it.
- `SSEVLLMGeneration` [grpo]: `VLLMGeneration.__init__` calls `self._init_vllm()`; `generate()` samples through
  `self.llm` and returns `(prompt_ids, completion_ids, ...)`; the trainer calls `sync_weights()` when the step
  changed. Both are timed (`time/rollout_s`, `rollout_tokens_per_s`, `time/weight_push_s`). With
  `enable_sleep_mode`, generate() calls `sync_weights()` while `self._llm_weights_sleeping`, then
  `llm.wake_up(tags=["kv_cache"])`, generates and sends the engine back to sleep (level 2).
- `ShardedStateMixin` [sft, grpo, only with `trainer.sharding: fsdp`]: transformers builds accelerate's FSDP plugin
  from `args.fsdp_plugin_args` in `create_accelerator_and_postprocess`, which sets `self.is_fsdp_enabled`; accelerate
  drops the plugin on CPU ranks (`DistributedType.MULTI_CPU`) and would wrap the model in DDP instead;
  `AcceleratorState.__init__` copies `PartialState._shared_state` (its `distributed_type`) over its own; accelerate
  sets the plugin's `mixed_precision_policy` (FSDP2's `MixedPrecisionPolicy`) before, and `fully_shard` takes it
  when the trainer prepares the model, after.
- `SSEVLLMGeneration.sync_weights` [grpo]: `VLLMGeneration._iter_named_params()` yields the trainer's parameters one
  at a time, gathered in full under FSDP2 (`full_tensor()`) and named as vLLM expects; every rank must iterate it.
- `set_logprob_chunks` [sft, grpo]: TRL's fused LM head (`add_fused_lm_head`, which SFTTrainer and GRPOTrainer install
  on the model) scores tokens in tiles of `trl.kernels.chunked_logprob.TOKEN_CHUNK_SIZE` tokens by
  `trl.trainer.utils._CHUNKED_LOGPROB_CHUNK_SIZE` vocabulary entries, both module globals read at each call.
- `log_train_metric` [grpo]: `GRPOTrainer._metrics["train"][name]` lists are averaged into the next log.
- `mark_weights_loaded` [grpo, periodic eval]: `GRPOTrainer._last_loaded_step`.
"""
import dataclasses
import math
import os
import shutil
import time
from pathlib import Path

import torch
import trl.kernels.chunked_logprob
import trl.trainer.utils
from accelerate import PartialState
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
from transformers.trainer_utils import rotate_checkpoints
from trl.generation.vllm_generation import VLLMGeneration
from trl.trainer.utils import ensure_master_addr_port

from eval.engine import reporting_slow_start
from pipeline.faults import fault_point
from pipeline.partition_routes import RouteFeed, aligned_routes, flip_metrics
from pipeline.rollouts import SeededLLM, push_and_check
from pipeline.rundir import latest_checkpoint
from pipeline.token_weights import TokenWeightCollator, TokenWeighting
from sse_model.hub_code import save_model_code
from tasks.files import replace_dir


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
            if self.args.should_save:
                save_model_code(staging / name)  # loadable without sse-rl (sse_model/hub_code.py)
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
            replace_dir(staging / name, run_dir / name)
            staging.rmdir()
            rotate_checkpoints(output_dir=str(run_dir), save_total_limit=self.args.save_total_limit, use_mtime=False)

    def training_step(self, model, inputs, num_items_in_batch=None):
        loss = super().training_step(model, inputs, num_items_in_batch)
        fault_point(f"{self.stage}.step", self.state.global_step + 1, Path(self.args.output_dir).parent)
        if not torch.isfinite(loss).all():
            last = latest_checkpoint(Path(self.args.output_dir))
            raise NonFiniteLoss(f"loss is {loss.item()} at step {self.state.global_step + 1}; the stage stops here "
                                f"and the last good checkpoint, {last.name if last else 'none yet'}, is kept")
        return loss


class ExactStepsOnResumeMixin:
    """Mix in before a `transformers.Trainer` subclass. A stage killed after its last checkpoint (written at
    `max_steps`) and before it is marked done resumes from that checkpoint; the Trainer would then run one step more
    (it tests `max_steps` only after a step, and with `max_steps` inside the first epoch there is an epoch left to
    enter). Here a checkpoint that already reached `max_steps` leaves no epoch to run: the resumed `train()` loads
    it, trains nothing, and the stage ends with the same steps and weights as an uninterrupted run."""

    def _init_training_state(self, max_steps, num_update_steps_per_epoch, num_train_epochs, resume_from_checkpoint,
                             trial):
        position = super()._init_training_state(max_steps, num_update_steps_per_epoch, num_train_epochs,
                                                resume_from_checkpoint, trial)
        if resume_from_checkpoint is not None and self.state.global_step >= max_steps:
            return num_train_epochs, 0
        return position


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


class TokenCountInStateMixin:
    """Mix in before `trl.SFTTrainer`. TRL counts the tokens it logs as `num_tokens` in an attribute that
    checkpoints do not keep, so a resumed run would count from 0 again. The count lives in the trainer state
    (saved with every checkpoint and otherwise unused here; TRL's GRPOTrainer keeps its count there too)."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        self._total_train_tokens = self.state.num_input_tokens_seen
        result = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        self.state.num_input_tokens_seen = self._total_train_tokens
        return result


class TokenWeightedLossMixin:
    """Mix in before `trl.SFTTrainer`: SILA's token-weighted loss (pipeline/token_weights.py), on when the trainer is
    built with `token_weights` (a `TokenWeighting`). The prepared dataset gets a `token_weights` column, which the
    collator batches; each loss term of TRL's loss is multiplied by (1 - e^(-step/tau)) w + e^(-step/tau), exactly 1
    at step 0. Without `token_weights` nothing changes."""

    def __init__(self, *args, token_weights: TokenWeighting | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.token_weighting = token_weights
        if token_weights is None:
            return
        data = self.train_dataset
        with self.accelerator.main_process_first():  # the main process computes and caches, the others read
            weights = token_weights.for_dataset(list(data["input_ids"]), list(data["labels"]),
                                                self.processing_class, self.args.device)
        self.train_dataset = data.add_column("token_weights", weights)
        self.data_collator = TokenWeightCollator(self.data_collator)

    def _set_signature_columns_if_needed(self):
        super()._set_signature_columns_if_needed()
        if self.token_weighting is not None and "token_weights" not in self._signature_columns:
            self._signature_columns = [*self._signature_columns, "token_weights"]

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        weights = inputs.pop("token_weights", None)
        if weights is None:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        decay = math.exp(-self.state.global_step / self.token_weighting.tau)
        scale = ((1 - decay) * weights + decay)[:, :-1]  # log_probs[:, p] is the term of input position p

        def weigh(module, args, output):
            output.log_probs = output.log_probs * scale
            return output

        hook = self.model.register_forward_hook(weigh)
        try:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        finally:
            hook.remove()


class ShardedStateMixin:
    """Mix in before a `transformers.Trainer` subclass: `trainer.sharding` (FSDP2 through accelerate, set up by
    `pipeline.training.sharding_args`) on CPU ranks as on GPUs. Accelerate enables its FSDP plugin for GPU-like
    devices only; on CPU gloo ranks it would silently fall back to DDP (every rank the whole state). FSDP2 itself
    runs on gloo, so the plugin is put back and the trainer prepares the model as it does on GPUs: what the
    multi-rank CPU tests check is the code path of the GPU run. Without `fsdp` in the arguments nothing changes.

    With bf16 (`model.dtype: bfloat16`), accelerate gives FSDP2 bfloat16 for the gathered parameters and for the
    gradient reduce-scatter alike; the gradients are reduced in float32 here instead, as DDP all-reduces the float32
    gradients of float32 master weights (and as torchtitan and verl reduce by default): a bfloat16 sum over the ranks
    would round each step's gradient by more the more ranks there are."""

    def create_accelerator_and_postprocess(self):
        super().create_accelerator_and_postprocess()
        state = self.accelerator.state
        if self.args.fsdp_plugin_args is None:
            return
        if state.distributed_type == DistributedType.MULTI_CPU:
            plugin = FullyShardedDataParallelPlugin(**self.args.fsdp_plugin_args)
            if state.mixed_precision != "no":  # as accelerate does for a GPU
                plugin.set_mixed_precision(state.mixed_precision)
            state.fsdp_plugin, state.distributed_type = plugin, DistributedType.FSDP
            # Every later `AcceleratorState()` copies PartialState's shared state over its own, distributed_type
            # included: GRPOTrainer's `set_seed(..., device_specific=True)` makes one after this, and its model was
            # then wrapped in DDP, not sharded. Both say FSDP, as accelerate's own GPU set-up leaves them.
            PartialState._shared_state["distributed_type"] = DistributedType.FSDP
            self.is_fsdp_enabled = True
        policy = state.fsdp_plugin.mixed_precision_policy  # FSDP2 reduces in param_dtype without a reduce_dtype
        if policy is not None and (policy.reduce_dtype or policy.param_dtype) not in (None, torch.float32):
            state.fsdp_plugin.mixed_precision_policy = dataclasses.replace(policy, reduce_dtype=torch.float32)


def set_logprob_chunks(tokens: int, vocab: int) -> None:
    """Tile TRL's fused LM head (`trainer.logprob_chunk_tokens` x `trainer.logprob_chunk_vocab`): the SFT loss and
    GRPO's per-token log-probabilities and entropies are computed from [tokens, vocab] logit tiles in the compute
    dtype, never the [T, V] float32 logits. One trainer per process, so the process-wide setting is the stage's."""
    trl.kernels.chunked_logprob.TOKEN_CHUNK_SIZE = tokens
    trl.trainer.utils._CHUNKED_LOGPROB_CHUNK_SIZE = vocab


class OwnRolloutEngineMixin:
    """Mix in before `trl.GRPOTrainer`: rollouts come from `SSEVLLMGeneration` with the engine the pipeline builds
    (`engine`: `vllm.LLM` arguments). TRL would build its own engine when `use_vllm` is set, so the trainer is
    constructed with vLLM off and the engine attached after. The subclass defines `rollout_seed_base()`."""

    def __init__(self, *, engine: dict, parity_ids: list[int], parity_threshold: float,
                 partition_replay: bool = False, route_flip_rate: bool = False, **kwargs):
        args = kwargs["args"]
        args.use_vllm = False
        super().__init__(**kwargs)
        args.use_vllm = self.use_vllm = True
        self.partition_replay, self.route_flip_rate = partition_replay, route_flip_rate
        self.vllm_generation = SSEVLLMGeneration(
            engine_kwargs=engine, seed_base=self.rollout_seed_base, parity_ids=parity_ids,
            record_routes=partition_replay or route_flip_rate,
            parity_threshold=parity_threshold, log=lambda name, value: log_train_metric(self, name, value),
            model=self.model, accelerator=self.accelerator, processing_class=self.processing_class,
            max_num_seqs=engine.get("max_num_seqs"), repetition_penalty=self.repetition_penalty,
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
            max_completion_length=self.max_completion_length, logprobs=0, generation_kwargs=args.generation_kwargs)
        mark_weights_loaded(self, -1)  # TRL's tag: the first rollout pushes the weights

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        # On several ranks TRL's scoring ends in a gather, where a rank that finished its rollout first waits for
        # the others: a barrier before it times that wait apart, so `time/scoring_s` is the rewards' own time.
        if self.accelerator.num_processes > 1:
            started = time.perf_counter()
            self.accelerator.wait_for_everyone()
            log_train_metric(self, "time/rank_wait_s", time.perf_counter() - started)
        started = time.perf_counter()
        rewards = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        log_train_metric(self, "time/scoring_s", time.perf_counter() - started)
        return rewards

    def _route_feed(self, source, flips: bool):
        """`RouteFeed` on the policy's backbone: replaying under `grpo.partition_replay`, counting route flips
        into the step's metrics when `flips`."""
        def log_flips(flipped, counted):
            for name, value in flip_metrics(flipped, counted).items():
                log_train_metric(self, name, value)
        return RouteFeed(self.accelerator.unwrap_model(self.model).base_model, source, replay=self.partition_replay,
                         on_flips=log_flips if flips else None)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        routes = inputs.get("partition_routes")
        if routes is None:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        # (a copy without them: with num_iterations > 1 TRL gives the same dict again)
        inputs = {name: value for name, value in inputs.items() if name != "partition_routes"}
        with self._route_feed(lambda offset, count, mask: routes[offset:offset + count],
                              flips=self.route_flip_rate and model.training):
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    def _generate_and_score_completions(self, inputs):
        llm = self.vllm_generation.llm
        if not llm.record_routes:
            return self._score_completions(inputs)
        # The passes inside after the rollout (old and reference log-probabilities) run on its rows in order;
        # the parity probe of the weight push before it has none.
        llm.last_routes = None

        def rollout_rows(offset, count, mask):
            return None if llm.last_routes is None else aligned_routes(llm.last_routes[offset:offset + count], mask)
        with self._route_feed(rollout_rows, flips=False):
            output = self._score_completions(inputs)
        output["partition_routes"] = aligned_routes(
            llm.last_routes, torch.cat([output["prompt_mask"], output["completion_mask"]], 1))
        return output

    def _score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        if self.model.training and "old_per_token_logps" in output and "sampling_per_token_logps" in output:
            kl = rollout_kl(output["sampling_per_token_logps"], output["old_per_token_logps"],
                            output["completion_mask"])
            if kl is not None:
                log_train_metric(self, "sampling/kl_rollout_trainer", kl)
        return output


class SSEVLLMGeneration(VLLMGeneration):
    """TRL's colocated generation with the pipeline's engine (pipeline/rollouts.py): seeded requests, and weights
    pushed through vLLM's layerwise reload with a parity probe after each push. `log(name, value)` gets the parity
    and the time of each rollout and push."""

    def __init__(self, *, engine_kwargs: dict, seed_base, parity_ids: list[int], parity_threshold: float,
                 log, record_routes: bool = False, **kwargs):
        self.engine_kwargs, self.seed_base, self.record_routes = engine_kwargs, seed_base, record_routes
        self.parity_ids, self.parity_threshold, self.log = parity_ids, parity_threshold, log
        super().__init__(mode="colocate", enable_sleep_mode=engine_kwargs.get("enable_sleep_mode", False), **kwargs)

    def _init_vllm(self):
        from vllm import LLM
        from vllm import __version__ as vllm_version

        from sse_model.vllm import seams as vllm_seams

        # vLLM's external launcher runs the engine in this process, inside the trainer's (possibly
        # single-rank) process group, as TRL's colocate mode does.
        os.environ.setdefault("RANK", str(self.accelerator.process_index))
        os.environ.setdefault("LOCAL_RANK", str(self.accelerator.local_process_index))
        os.environ.setdefault("WORLD_SIZE", str(self.accelerator.num_processes))
        ensure_master_addr_port()
        with reporting_slow_start("the GRPO rollout engine"):
            self.engine = LLM(**self.engine_kwargs, distributed_executor_backend="external_launcher",
                              logprobs_mode="processed_logprobs")
        # into the stage log: vLLM's own line about its runner does not reach it
        runner = vllm_seams.model_runner(self.engine)
        print(f"rollout engine: vLLM {vllm_version}, {runner} model runner", flush=True)
        self.llm = SeededLLM(self.engine, self.seed_base, self.record_routes)  # what TRL's generate() uses
        if self.enable_sleep_mode:  # as TRL's own colocated engine: asleep until the first rollout needs it
            self.engine.sleep(level=2)
        # Level 2 drops the weights: TRL's generate() pushes them (sync_weights) before it wakes the cache
        self._llm_weights_sleeping = self.enable_sleep_mode
        self.accelerator.wait_for_everyone()

    def generate(self, prompts, *args, **kwargs):
        started = time.perf_counter()
        out = super().generate(prompts, *args, **kwargs)
        seconds = time.perf_counter() - started
        self.log("time/rollout_s", seconds)
        self.log("rollout_tokens_per_s", sum(map(len, out[1])) / seconds)
        return out

    def sync_weights(self):
        # TRL's iterator gathers one parameter at a time (every rank takes part under FSDP2), and vLLM's layerwise
        # reload takes them as they come, so no rank ever holds the full model's weights twice.
        started = time.perf_counter()
        if self.enable_sleep_mode:
            # The push needs the weights mapped and the parity probe runs a request, so both wake here; TRL's
            # generate() then asks for the cache again, which vLLM skips for a tag that is awake.
            torch.cuda.empty_cache()
            self.engine.wake_up()
            self._llm_weights_sleeping = False
        model = self.accelerator.unwrap_model(self.model)
        self.log("vllm_parity", push_and_check(self.engine, model, self._iter_named_params(), self.parity_ids,
                                               self.parity_threshold))
        self.log("time/weight_push_s", time.perf_counter() - started)


def rollout_kl(sampler_logps: torch.Tensor, trainer_logps: torch.Tensor, mask: torch.Tensor) -> float | None:
    """Mean per-token KL(sampler || trainer) over the completion tokens, from the log-probabilities both give the
    sampled tokens: Schulman's k3 estimator E[r - 1 - log r] with r = p_trainer / p_sampler, which is unbiased for
    tokens drawn from the sampler and never negative. Tokens either side could not score (NaN) are left out;
    None when none is left."""
    log_ratio = (trainer_logps - sampler_logps).float()
    keep = mask.bool() & ~torch.isnan(log_ratio)
    if not keep.any():
        return None
    log_ratio = log_ratio[keep]
    return (torch.expm1(log_ratio) - log_ratio).mean().item()


def log_train_metric(trainer, name: str, value: float) -> None:
    """Log `value` with the trainer's own metrics of this step (averaged into the next log line)."""
    trainer._metrics["train"][name].append(value)


def mark_weights_loaded(trainer, step: int) -> None:
    """Tell GRPOTrainer that the engine holds the weights of `step` (-1: none yet), so it pushes them only when
    the step has changed since."""
    trainer._last_loaded_step = step
