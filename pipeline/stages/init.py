"""Stage `init`: the model the pipeline starts from.

- scratch: an SSE-H (or baseline) from `model.config`, with a byte-level BPE tokenizer trained on the SFT data
  when `model.tokenizer.train` is set (the embedded default), else the tokenizer at `model.tokenizer.path`;
- pretrained: an existing `sse_hybrid` checkpoint at `model.path`, checked, used in place.
"""
import os
import shutil

import torch
from transformers import AutoConfig, AutoTokenizer

from pipeline.data.loaders import load_sft_dataset
from pipeline.data.tokenizer import conversation_texts, train_tokenizer
from pipeline.rundir import fsync_dir
from sse_model import SSEConfig, SSEForCausalLM


class CheckpointError(ValueError):
    pass


def check_sse_checkpoint(path: str) -> SSEConfig:
    """Refuse a checkpoint of another architecture with a message that says what it is."""
    try:
        config = AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{path}: not a loadable model checkpoint ({err})") from err
    if not isinstance(config, SSEConfig):
        raise CheckpointError(f"{path}: model_type {config.model_type!r} is not an SSE-H checkpoint (sse_hybrid); "
                              "convert it first (stage `convert`, or `sse-rl convert`)")
    return config


def build_tokenizer(cfg):
    settings = cfg.model.tokenizer
    if settings.train:
        texts = conversation_texts(load_sft_dataset(cfg.data.sft))
        return train_tokenizer(texts, vocab_size=settings.vocab_size,
                               model_max_length=cfg.model.config.get("max_position_embeddings", 32768))
    if not settings.path:
        raise ValueError("model.tokenizer: set `train: true` or a `path` for a model built from scratch")
    return AutoTokenizer.from_pretrained(settings.path)


def build_config(cfg, tokenizer) -> SSEConfig:
    kwargs = dict(cfg.model.config)
    preset = kwargs.pop("preset", None)
    kwargs.update(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                  bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    return SSEConfig.from_preset(preset, **kwargs) if preset else SSEConfig(**kwargs)


def run(cfg, run_dir, model_path=None) -> dict:
    if cfg.model.init == "pretrained":
        config = check_sse_checkpoint(cfg.model.path)
        return {"output": cfg.model.path, "summary": f"pretrained {config.model_type} at {cfg.model.path}"}

    tokenizer = build_tokenizer(cfg)
    config = build_config(cfg, tokenizer)
    torch.manual_seed(cfg.seed)
    model = SSEForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id

    out = run_dir.stage_dir("init") / "model"
    staging = out.with_name(".partial-model")
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    shutil.rmtree(out, ignore_errors=True)
    os.rename(staging, out)
    fsync_dir(out.parent)
    n_params = sum(p.numel() for p in model.parameters())
    return {"output": str(out), "summary": f"{n_params / 1e6:.2f}M parameters, "
            f"{config.layer_types.count('linear_attention')}/{config.num_hidden_layers} SSE layers, "
            f"vocabulary {len(tokenizer)}"}
