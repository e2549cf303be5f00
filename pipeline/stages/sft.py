"""Stage `sft`: distillation with TRL's SFTTrainer (chat template, loss on completions only, packing or
padding-free batches when configured; Zoology-format MQAR: code sequences with the loss on the answer codes).
Resumes from the stage's last complete checkpoint."""
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import SFTConfig, SFTTrainer

import sse_model  # noqa: F401  (registers sse_hybrid with the Auto classes)
from pipeline.token_weights import TokenWeighting
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
    ShardedStateMixin,
    TokenCountInStateMixin,
    TokenWeightedLossMixin,
    set_logprob_chunks,
)
from tasks.loaders import DataError, is_code_sequence, load_sft_dataset, tokenize_codes
from tasks.prompts import sft_template_problem


class SSESFTTrainer(AtomicCheckpointsMixin, ExactStepsOnResumeMixin, BalanceLossMixin, TokenCountInStateMixin,
                    TokenWeightedLossMixin, ShardedStateMixin, SFTTrainer):
    stage = "sft"


def run(cfg, run_dir, model_path) -> dict:
    s = cfg.sft
    out = run_dir.stage_dir("sft")
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=weights_dtype(cfg))
    dataset = load_sft_dataset(cfg.data.sft)
    if is_code_sequence(cfg.data.sft):  # no chat template: TRL takes the tokens and completion mask as they are
        dataset = tokenize_codes(dataset, tokenizer)
    elif problem := sft_template_problem(tokenizer):  # checked before the run too (pipeline/preflight.py)
        raise DataError(f"{model_path}: the tokenizer's chat template {problem}")
    set_logprob_chunks(cfg.trainer.logprob_chunk_tokens, cfg.trainer.logprob_chunk_vocab)
    args = SFTConfig(**common_training_args(cfg, s, out), num_train_epochs=s.epochs, completion_only_loss=True)
    w = s.token_weights  # SILA's token-weighted loss; None: off
    weighting = None if w is None else TokenWeighting(reference=w.reference or cfg.convert.source,
                                                      threshold=w.threshold, tau=w.tau, cache_dir=out)
    trainer = SSESFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer,
                            callbacks=[StageCallback(run_dir, "sft", model)], token_weights=weighting)
    resume = resume_checkpoint(run_dir, "sft")
    result = trainer.train(resume_from_checkpoint=str(resume) if resume else None)
    final = save_final_model(trainer, tokenizer, out / "final")
    return {"output": str(final), "steps": trainer.state.global_step,
            "summary": f"{trainer.state.global_step} steps, final train loss {result.training_loss:.4f}"
                       + (f" (resumed from {resume.name})" if resume else "")}
