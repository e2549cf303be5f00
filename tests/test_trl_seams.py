"""One test per seam of pipeline/trl_seams.py: each fails when the installed TRL or transformers changes the
internal the pipeline relies on (a private attribute, the signature of an overridden method, where the library
calls it). The behaviour through the seams is tested end to end elsewhere (tests/test_pipeline.py,
tests/test_reliability.py); these say which seam broke, in seconds, after an upgrade."""
import inspect

import pytest
import torch
from transformers import Trainer, trainer_utils
from trl import GRPOTrainer, SFTTrainer
from trl.generation.vllm_generation import VLLMGeneration

from pipeline import trl_seams


def source(function) -> str:
    return inspect.getsource(function)


def parameters(function) -> list[str]:
    return list(inspect.signature(inspect.unwrap(function)).parameters)  # through TRL's profiling decorator


@pytest.mark.parametrize("trainer", [SFTTrainer, GRPOTrainer])
def test_atomic_checkpoints_seam(trainer):
    """`_save_checkpoint(model, trial)` writes `checkpoint-<step>` under `_get_output_dir(trial)` (the mixin points
    that at a staging directory); `training_step(model, inputs, num_items_in_batch)` returns the loss before the
    optimizer steps; `rotate_checkpoints` takes the arguments the mixin passes."""
    assert parameters(trainer._save_checkpoint) == ["self", "model", "trial"]
    save = source(Trainer._save_checkpoint)
    assert "self._get_output_dir(trial" in save and "checkpoint-{self.state.global_step}" in save.replace(
        "PREFIX_CHECKPOINT_DIR}-", "checkpoint-")
    assert parameters(trainer._get_output_dir) == ["self", "trial"]
    assert parameters(Trainer.training_step)[:4] == ["self", "model", "inputs", "num_items_in_batch"]
    # TRL's override takes the same arguments, or passes them on as they are
    assert parameters(trainer.training_step)[:4] == ["self", "model", "inputs", "num_items_in_batch"] or \
        parameters(trainer.training_step) == ["self", "args", "kwargs"]
    assert "optimizer.step" not in source(Trainer.training_step) + source(trainer.training_step)
    assert {"output_dir", "save_total_limit", "use_mtime"} <= set(parameters(trainer_utils.rotate_checkpoints))


@pytest.mark.parametrize("trainer", [SFTTrainer, GRPOTrainer])
def test_exact_steps_on_resume_seam(trainer):
    """`_init_training_state` takes the arguments the mixin passes on and returns the epoch and batch to resume
    from; the loop runs the epochs from that one to `num_train_epochs` (so returning `num_train_epochs` runs none)."""
    assert parameters(trainer._init_training_state) == ["self", "max_steps", "num_update_steps_per_epoch",
                                                       "num_train_epochs", "resume_from_checkpoint", "trial"]
    assert "return epochs_trained, steps_trained_in_current_epoch" in source(Trainer._init_training_state)
    loop = source(Trainer._inner_training_loop)
    assert "= self._init_training_state(" in loop and "for epoch in range(epochs_trained, num_train_epochs):" in loop


@pytest.mark.parametrize("trainer", [SFTTrainer, GRPOTrainer])
def test_balance_loss_seam(trainer):
    """`compute_loss(model, inputs, return_outputs, num_items_in_batch)`; the Trainer divides the loss by the
    accumulation steps unless the model normalised it by `num_items_in_batch` (the three attributes the mixin
    reads to scale the balance term the same way)."""
    assert parameters(trainer.compute_loss)[:5] == ["self", "model", "inputs", "return_outputs",
                                                     "num_items_in_batch"]
    step = source(Trainer.training_step)
    for name in ("model_accepts_loss_kwargs", "compute_loss_func", "current_gradient_accumulation_steps"):
        assert name in step or name in source(Trainer), name
    assert "current_gradient_accumulation_steps" in source(Trainer.training_step)


def test_balance_loss_seam_trl_calls_the_backbone():
    """TRL's SFT loss runs the model's backbone itself (a fused LM head), so the model's own loss, which adds the
    balance term, is never used: the mixin hooks `model.base_model` instead."""
    sft = source(SFTTrainer)
    assert "compute_loss" in sft and ("base_model" in sft or "get_decoder" in sft or "model.model" in sft)


def test_token_count_seam():
    """SFTTrainer counts the tokens it logs in `self._total_train_tokens`, inside compute_loss."""
    loss = source(SFTTrainer.compute_loss)
    assert "self._total_train_tokens" in loss and '"num_tokens"' in loss


def test_own_rollout_engine_seam():
    """GRPOTrainer builds VLLMGeneration in __init__ only when `args.use_vllm`; at generation it reads
    `self.use_vllm`, `self.vllm_generation` and `self._last_loaded_step`, and calls `sync_weights()` when the step
    changed; it has the sampling attributes the mixin hands the generation."""
    init = source(GRPOTrainer.__init__)
    assert "self.use_vllm = args.use_vllm" in init and "if self.use_vllm:" in init
    assert "self.vllm_generation = VLLMGeneration(" in init and "self._last_loaded_step = -1" in init
    for name in ("repetition_penalty", "temperature", "top_p", "top_k", "min_p", "max_completion_length"):
        assert f"self.{name} = " in init, name
    trainer = source(GRPOTrainer)
    assert "self.state.global_step != self._last_loaded_step" in trainer
    assert "self.vllm_generation.sync_weights()" in trainer and "self.vllm_generation.generate(" in trainer
    # the scoring of a generation batch, timed by the mixin: one call with these arguments
    assert parameters(GRPOTrainer._calculate_rewards) == ["self", "inputs", "prompts", "completions",
                                                           "completion_ids_list"]
    assert trainer.count("self._calculate_rewards(inputs, prompts, completions, completion_ids_list)") == 1


def test_rollout_kl_seam():
    """`_generate_and_score_completions(inputs)` returns the completion mask and, with vLLM importance sampling on
    (TRL's default), the trainer's and vLLM's log-probabilities of the sampled tokens under these keys."""
    assert parameters(GRPOTrainer._generate_and_score_completions) == ["self", "inputs"]
    body = source(GRPOTrainer._generate_and_score_completions)
    for key in ("completion_mask", "old_per_token_logps", "sampling_per_token_logps"):
        assert f'output["{key}"] = ' in body or f'"{key}": ' in body, key
    from trl import GRPOConfig
    assert GRPOConfig.vllm_importance_sampling_correction is True


def test_rollout_kl_estimates_the_kl_of_sampled_tokens():
    """k3 over tokens drawn from the sampler converges to the exact KL(sampler || trainer); equal log-probabilities
    give 0; masked and NaN tokens are left out; nothing left gives None."""
    g = torch.Generator().manual_seed(0)
    sampler = torch.log_softmax(torch.randn(50, generator=g), 0)
    trainer = torch.log_softmax(sampler + 0.3 * torch.randn(50, generator=g), 0)
    exact = (sampler.exp() * (sampler - trainer)).sum().item()
    tokens = torch.multinomial(sampler.exp(), 400_000, replacement=True, generator=g).view(4000, 100)
    mask = torch.ones_like(tokens)
    estimate = trl_seams.rollout_kl(sampler[tokens], trainer[tokens], mask)
    assert exact > 0.01 and abs(estimate - exact) < 0.03 * exact, (estimate, exact)
    assert trl_seams.rollout_kl(sampler[tokens], sampler[tokens], mask) == 0.0
    noisy = trainer[tokens].clone()
    noisy[:, 50:] = float("nan")
    mask[:, 40:50] = 0
    kept = trl_seams.rollout_kl(sampler[tokens], noisy, mask)
    assert kept == pytest.approx(trl_seams.rollout_kl(sampler[tokens][:, :40], trainer[tokens][:, :40],
                                                      mask[:, :40]))
    assert trl_seams.rollout_kl(sampler[tokens], trainer[tokens], torch.zeros_like(mask)) is None


def test_partition_routes_seam():
    """A `partition_routes` tensor in the dict `_generate_and_score_completions` returns reaches `compute_loss` with
    its rows: TRL shuffles and splits the generation batch along the first dimension of every tensor; the
    log-probability passes call the model on slices of the batch in order; prompts are left-padded and the
    completion follows them (`aligned_routes`)."""
    from trl.trainer.utils import shuffle_sequence_dict, split_tensor_dict
    batch = {"prompt_ids": torch.arange(6)[:, None], "partition_routes": torch.arange(6)[:, None, None, None]}
    for part in split_tensor_dict(shuffle_sequence_dict(batch), 3):
        assert torch.equal(part["partition_routes"].flatten(), part["prompt_ids"].flatten())
    body = source(GRPOTrainer._generate_and_score_completions)
    assert "prompt_completion_ids = torch.cat([prompt_ids, completion_ids], dim=1)" in body
    assert 'padding_side="left"' in body and 'completion_mask, padding_value=0, padding_side="right"' in body
    assert "split_tensor_dict(generation_batch" in source(GRPOTrainer._prepare_inputs)
    logps = source(GRPOTrainer._get_per_token_logps_and_entropies)
    assert "for start in range(0, input_ids.size(0), batch_size):" in logps
    assert '{"input_ids": input_ids_batch, "attention_mask": attention_mask_batch}' in logps
    assert parameters(GRPOTrainer.compute_loss) == ["self", "model", "inputs", "return_outputs", "num_items_in_batch"]


def test_vllm_generation_seam():
    """VLLMGeneration takes the arguments the pipeline passes, calls `self._init_vllm()` from __init__, samples
    through `self.llm`, and reads `_llm_weights_sleeping`; `ensure_master_addr_port` exists."""
    passed = {"model", "accelerator", "processing_class", "mode", "max_num_seqs", "repetition_penalty",
              "temperature", "top_p", "top_k", "min_p", "max_completion_length", "logprobs", "generation_kwargs",
              "enable_sleep_mode"}
    assert passed <= set(parameters(VLLMGeneration.__init__))
    assert "self._init_vllm()" in source(VLLMGeneration.__init__)
    assert "self.llm.generate(" in source(VLLMGeneration)
    assert "_llm_weights_sleeping" in source(VLLMGeneration)
    assert parameters(VLLMGeneration.sync_weights) == ["self"]
    # generate() returns (prompt_ids, completion_ids, ...): the rollout timer counts completion_ids' tokens
    assert "return prompt_ids, completion_ids, " in source(VLLMGeneration.generate)
    from trl.trainer.utils import ensure_master_addr_port

    assert callable(ensure_master_addr_port)


def test_sleep_mode_seam():
    """With sleep mode, TRL's generate() pushes the weights while `_llm_weights_sleeping`, wakes the cache, samples
    and puts the engine back to sleep at level 2 (which drops the weights again)."""
    generate = source(VLLMGeneration.generate)
    push = generate.index("self._llm_weights_sleeping:\n            self.sync_weights()")
    wake = generate.index('self.llm.wake_up(tags=["kv_cache"])')
    sample = generate.index("self.llm.generate(")
    sleep = generate.index("self.llm.sleep(level=2)", sample)
    assert push < wake < sample < sleep
    assert "self._llm_weights_sleeping = True" in generate[sleep:]


def test_sleeping_engine_wakes_before_the_push(monkeypatch):
    """The pipeline's push wakes the whole engine first (weights for the push, the cache for the parity probe's
    request) and records that the weights are back; without sleep mode it wakes nothing."""
    calls = []

    class Engine:
        def wake_up(self, tags=None):
            calls.append(("wake_up", tags))

    def push_and_check(engine, model, named, ids, threshold):
        calls.append(("push", list(named)))
        return 0.0

    monkeypatch.setattr(trl_seams, "push_and_check", push_and_check)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append(("empty_cache",)))
    for sleeping in (True, False):
        calls.clear()
        generation = object.__new__(trl_seams.SSEVLLMGeneration)
        generation.engine, generation.enable_sleep_mode = Engine(), sleeping
        generation._llm_weights_sleeping, generation.parity_ids, generation.parity_threshold = sleeping, [1], 1.0
        generation.model, generation.log = torch.nn.Linear(2, 2), lambda name, value: None
        generation.accelerator = type("Accelerator", (), {"unwrap_model": staticmethod(lambda m: m)})()
        generation._iter_named_params = lambda: iter([("w", torch.ones(1))])
        generation.sync_weights()
        expected = [("empty_cache",), ("wake_up", None)] if sleeping else []
        assert calls == expected + [("push", [("w", torch.ones(1))])] and not generation._llm_weights_sleeping


def test_train_metrics_seam():
    """`_metrics["train"][name]` lists, created on first use, are averaged into the next log line."""
    init, log = source(GRPOTrainer.__init__), source(GRPOTrainer.log)
    assert "self._metrics = {" in init and "defaultdict(list)" in init
    assert "for key, val in self._metrics[mode].items()" in log and "sum(valid) / len(valid)" in log


def test_the_seams_module_lists_every_seam():
    """The list in the module docstring names every class and function the module defines."""
    doc = trl_seams.__doc__
    for name, value in vars(trl_seams).items():
        if getattr(value, "__module__", None) == trl_seams.__name__ and not name.startswith("_") \
                and not issubclass_error(value):
            assert f"`{name}`" in doc, name


def issubclass_error(value) -> bool:
    return isinstance(value, type) and issubclass(value, Exception)


def test_token_weighted_loss_seam():
    """SFT's loss is minus the fused LM head's `log_probs` of the top-level model's forward (the mixin scales them in
    a forward hook), whose entry p is the term of hidden state p and label p + 1; the Trainer keeps the dataset
    columns named in `_signature_columns`; TRL's collator pads on the right and says whether it is padding-free."""
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling
    from trl.trainer.utils import add_fused_lm_head

    loss = source(SFTTrainer.compute_loss)
    assert "outputs = model(**inputs, fused_lm_head=True)" in loss and "per_token_loss = -outputs.log_probs" in loss
    head = source(add_fused_lm_head)
    assert "last_hidden_state[:, :-1]" in head and "labels = labels[:, 1:]" in head
    assert parameters(SFTTrainer._set_signature_columns_if_needed) == ["self"]
    assert "self._signature_columns" in source(Trainer._remove_unused_columns)
    collate = source(DataCollatorForLanguageModeling.torch_call)
    assert 'padding_side="right"' in collate and "self.padding_free" in collate


@pytest.mark.parametrize("trainer", [SFTTrainer, GRPOTrainer])
def test_sharded_state_seam(trainer):
    """transformers builds accelerate's FSDP plugin from `args.fsdp_plugin_args` in
    `create_accelerator_and_postprocess` and reads `is_fsdp_enabled` from the state; accelerate enables FSDP for
    GPU-like devices only, so CPU ranks (MULTI_CPU) need the mixin. A later `AcceleratorState()` (GRPOTrainer's
    `set_seed(..., device_specific=True)`) copies PartialState's `distributed_type` over its own, so the mixin sets
    both."""
    from accelerate import state
    from accelerate.utils import fsdp_utils

    create = source(Trainer.create_accelerator_and_postprocess)
    assert "self.args.fsdp_plugin_args" in create
    assert 'self.is_fsdp_enabled = getattr(self.accelerator.state, "fsdp_plugin", None) is not None' in create
    assert "DistributedType.MULTI_CPU" not in source(state.AcceleratorState.__init__).split(
        "self.distributed_type = DistributedType.FSDP")[0].rsplit("elif self.distributed_type in [", 1)[1]
    assert trainer.create_accelerator_and_postprocess is Trainer.create_accelerator_and_postprocess
    assert "self.__dict__.update(PartialState._shared_state)" in source(state.AcceleratorState.__init__)
    assert '"mp_policy": fsdp2_plugin.mixed_precision_policy' in source(fsdp_utils.fsdp2_prepare_model)


def test_push_iterator_seam():
    """`VLLMGeneration._iter_named_params()` yields (vLLM name, full tensor) one parameter at a time, through
    `full_tensor()` under FSDP2."""
    assert parameters(VLLMGeneration._iter_named_params) == ["self"]
    assert "param.full_tensor()" in source(VLLMGeneration._iter_fsdp2_params)
    assert inspect.isgeneratorfunction(VLLMGeneration._iter_named_params)


def test_logprob_chunks_seam():
    """TRL's fused LM head passes the module global `_CHUNKED_LOGPROB_CHUNK_SIZE` (vocabulary tile) at each call, and
    its kernel tiles tokens by the module global `TOKEN_CHUNK_SIZE`; both trainers install the head."""
    import trl.kernels.chunked_logprob as kernel
    import trl.trainer.utils as utils

    assert "_CHUNKED_LOGPROB_CHUNK_SIZE," in source(utils.add_fused_lm_head)
    assert (kernel.TOKEN_CHUNK_SIZE, utils._CHUNKED_LOGPROB_CHUNK_SIZE) == (4096, 32768)  # config defaults
    assert "TOKEN_CHUNK_SIZE" in source(kernel.ChunkedLogProbFunction.forward)
    assert "add_fused_lm_head(" in source(SFTTrainer.__init__) and "add_fused_lm_head(" in source(GRPOTrainer.__init__)
