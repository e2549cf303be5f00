"""Tiny random checkpoints and models built on the spot, for the tests.

Nothing is downloaded: `save_checkpoint` (the vLLM backend's tests) uses a byte-level BPE trained on a fixed text,
and the model vocabulary is exactly the tokenizer's, so every id a random model samples decodes; `tiny_source` (the
conversion and SILA tests) saves a Qwen3 / Qwen2 / Llama source with a character tokenizer and a chat template;
`small_sse_h` is the SSE-H of the Triton model-step test.
"""
import string
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    GenerationConfig,
    LlamaConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3Config,
)

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


FAMILIES = {"qwen3": Qwen3Config, "qwen2": Qwen2Config, "llama": LlamaConfig}
ALPHABET = string.ascii_lowercase + string.digits + "+=:?>. \n"
SPECIAL_TOKENS = ["<pad>", "<bos>", "<eos>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}:{{ m['content'] }}<|im_end|>{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant:{% endif %}")


def char_tokenizer() -> PreTrainedTokenizerFast:
    """One token per character of ALPHABET, plus pad/bos/eos and chat markers, with a chat template."""
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + list(ALPHABET))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>",
                                   additional_special_tokens=SPECIAL_TOKENS[3:], chat_template=CHAT_TEMPLATE)


def tiny_source(family: str, path, *, hidden_size=128, num_layers=6, num_heads=4, num_kv_heads=2, head_dim=32,
                seed=0, **overrides):
    """A random-weight `family` model with the character tokenizer and a sampling generation config, saved to
    `path` (a conversion's source); returns the model."""
    torch.manual_seed(seed)
    config = FAMILIES[family](
        vocab_size=64, hidden_size=hidden_size, intermediate_size=3 * hidden_size, num_hidden_layers=num_layers,
        num_attention_heads=num_heads, num_key_value_heads=num_kv_heads, head_dim=head_dim,
        max_position_embeddings=1024, tie_word_embeddings=family == "qwen3", pad_token_id=0, bos_token_id=1,
        eos_token_id=2, **overrides)
    model = AutoModelForCausalLM.from_config(config).eval()
    model.save_pretrained(path)
    char_tokenizer().save_pretrained(path)
    GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=0, do_sample=True, temperature=0.7,
                     max_new_tokens=64).save_pretrained(path)
    return model


def small_sse_h(width: int, device: str, seed: int):
    """Two SSE layers (n4k1 + shared, LoRA 16), then attention; float32."""
    from sse_model import SSEConfig, SSEForCausalLM
    config = SSEConfig(vocab_size=512, hidden_size=width, intermediate_size=2 * width, num_hidden_layers=3,
                       layer_types=["linear_attention", "linear_attention", "full_attention"],
                       num_attention_heads=2, head_dim=width // 2, sse_num_partitions=4, sse_top_k=1,
                       sse_lora_rank=16)
    torch.manual_seed(seed)
    return SSEForCausalLM(config).to(device)
