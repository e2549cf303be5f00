"""Stage `init`: the model the pipeline starts from.

- scratch: an SSE-H (or baseline) from `model.config`, with a byte-level BPE tokenizer trained on the SFT data
  when `model.tokenizer.train` is set (the embedded default), else the tokenizer at `model.tokenizer.path`;
- pretrained: an existing `sse_hybrid` checkpoint at `model.path`, checked, used in place.
"""
import json
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoTokenizer
from transformers.utils import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME, cached_file

from sse_model import SSEConfig, SSEForCausalLM
from sse_model.configuration_sse import PRESETS
from sse_model.hub_code import save_model_code
from tasks.files import replace_dir
from tasks.loaders import load_sft_dataset
from tasks.tokenizer import conversation_texts, train_tokenizer


class CheckpointError(ValueError):
    pass


def check_sse_checkpoint(path: str) -> SSEConfig:
    """Refuse a checkpoint of another architecture, or whose tensors do not match its config, with a message that
    says what is wrong. Transformers only warns about missing tensors and initialises them at random."""
    try:
        config = AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{path}: not a loadable model checkpoint ({err})") from err
    if not isinstance(config, SSEConfig):
        raise CheckpointError(f"{path}: model_type {config.model_type!r} is not an SSE-H checkpoint (sse_hybrid); "
                              "convert it first (stage `convert`, or `sse-rl convert`)")
    problems = tensor_mismatches(config, checkpoint_tensor_shapes(path))
    if problems:
        raise CheckpointError(f"{path}: the tensors do not match its config.json: {'; '.join(problems)}")
    return config


def checkpoint_tensor_shapes(path: str) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor in the checkpoint's safetensors file(s), read from the headers only."""
    index = cached_file(path, SAFE_WEIGHTS_INDEX_NAME, _raise_exceptions_for_missing_entries=False)
    single = cached_file(path, SAFE_WEIGHTS_NAME, _raise_exceptions_for_missing_entries=False)
    if index:
        shards = json.loads(Path(index).read_text())["weight_map"].values()
        files = sorted({str(Path(index).parent / shard) for shard in shards})
    elif single:
        files = [single]
    else:
        raise CheckpointError(f"{path}: no {SAFE_WEIGHTS_NAME} or {SAFE_WEIGHTS_INDEX_NAME}")
    shapes = {}
    for file in files:
        with safe_open(file, "pt") as f:
            shapes.update((name, tuple(f.get_slice(name).get_shape())) for name in f.keys())
    return shapes


def tensor_mismatches(config: SSEConfig, shapes: dict[str, tuple[int, ...]], shown: int = 8) -> list[str]:
    """What differs between the tensors an SSE-H model of `config` has and `shapes`: missing (a tensor shared under
    several names, the tied embeddings, needs one of them), unexpected, or of another shape."""
    with torch.device("meta"):
        state = SSEForCausalLM(config).state_dict(keep_vars=True)
    groups = {}
    for name, tensor in state.items():
        groups.setdefault(id(tensor), []).append(name)
    missing = sorted(names[0] for names in groups.values() if not any(n in shapes for n in names))
    unexpected = sorted(set(shapes) - set(state))
    wrong = [f"{n} is {list(shapes[n])}, expected {list(state[n].shape)}" for n in sorted(set(shapes) & set(state))
             if shapes[n] != tuple(state[n].shape)]

    problems = []
    for label, items in ((f"{len(missing)} missing:", missing), (f"{len(unexpected)} unexpected:", unexpected),
                         ("shape mismatch:", wrong)):
        if items:
            more = f" and {len(items) - shown} more" if len(items) > shown else ""
            problems.append(f"{label} {', '.join(items[:shown])}{more}")
    return problems


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
    # The vocabulary is the tokenizer's unless model.config or its preset names a larger one: models pad their
    # embedding past the tokenizer (Qwen's 151,936 rows for 151,669 tokens), and a preset keeps its real size.
    named = kwargs.get("vocab_size", PRESETS.get(preset, {}).get("vocab_size"))
    if named is not None and named < len(tokenizer):
        where = "model.config.vocab_size" if "vocab_size" in kwargs else f"model.config.preset {preset}: vocab_size"
        raise ValueError(f"{where} {named} is smaller than the tokenizer's {len(tokenizer)} tokens")
    kwargs.update(vocab_size=named or len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                  bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    return SSEConfig.from_preset(preset, **kwargs) if preset else SSEConfig(**kwargs)


def check_rollout_length(cfg, config: SSEConfig) -> None:
    """vLLM refuses an engine whose context exceeds the model's positions; found here, not after SFT."""
    if "grpo" not in cfg.stages:
        return
    g = cfg.grpo
    need = g.max_prompt_length + g.trl["max_completion_length"]
    if need > config.max_position_embeddings:
        raise ValueError(f"grpo.max_prompt_length + grpo.max_completion_length = {need} tokens exceed the model's "
                         f"max_position_embeddings ({config.max_position_embeddings}): vLLM would refuse the rollout "
                         f"engine")


def run(cfg, run_dir, model_path=None) -> dict:
    if cfg.model.init == "pretrained":
        config = check_sse_checkpoint(cfg.model.path)
        check_rollout_length(cfg, config)
        return {"output": cfg.model.path, "summary": f"pretrained {config.model_type} at {cfg.model.path}"}

    tokenizer = build_tokenizer(cfg)
    config = build_config(cfg, tokenizer)
    check_rollout_length(cfg, config)
    torch.manual_seed(cfg.seed)
    model = SSEForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id

    out = run_dir.stage_dir("init") / "model"
    staging = out.with_name(".partial-model")
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(staging)
    save_model_code(staging)
    tokenizer.save_pretrained(staging)
    replace_dir(staging, out)
    n_params = sum(p.numel() for p in model.parameters())
    return {"output": str(out), "summary": f"{n_params / 1e6:.2f}M parameters, "
            f"{config.layer_types.count('linear_attention')}/{config.num_hidden_layers} SSE layers, "
            f"vocabulary {config.vocab_size}"
            + (f" (tokenizer {len(tokenizer)})" if config.vocab_size != len(tokenizer) else "")}
