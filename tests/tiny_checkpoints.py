"""Tiny random checkpoints with a locally built tokenizer, for the vLLM backend's tests.

Nothing is downloaded: the tokenizer is a byte-level BPE trained on a fixed text, and the model vocabulary is
exactly the tokenizer's, so every id a random model samples decodes.
"""
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

EOS = "<|endoftext|>"
_TEXT = ("The quick brown fox jumps over the lazy dog. 12 + 30 = 42. Sparse state expansion keeps one state per "
         "partition and routes every token to the top k partitions, plus a shared partition. ") * 20


def byte_bpe_tokenizer(vocab_size: int = 320) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([_TEXT], trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, bos_token=EOS, pad_token=EOS)


def save_checkpoint(path, config, seed: int = 0, tokenizer: PreTrainedTokenizerFast | None = None) -> Path:
    """A random model of `config` (its vocab_size set to the tokenizer's) saved with its tokenizer in `path`.
    `config` may be any transformers causal-LM config (SSEConfig, Qwen2Config for comparison); an SSEConfig comes
    from `sse_model`, whose import registers it with the Auto classes."""
    tokenizer = tokenizer or byte_bpe_tokenizer()
    config.vocab_size = len(tokenizer)
    config.eos_token_id = config.bos_token_id = config.pad_token_id = tokenizer.eos_token_id
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    path = Path(path)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
