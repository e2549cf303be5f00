"""A small byte-level BPE tokenizer with a ChatML template, trained on the fly for the embedded default.

Digits are split before BPE, so every digit is its own token and numbers are spelled digit by digit:
arithmetic stays learnable for a tiny model. The chat template marks assistant turns with
`{% generation %}` (TRL's assistant-only loss) and its end-of-turn token `<|im_end|>` is the EOS token,
inside the marked span, so the model learns to stop and generation stops there.
"""
from typing import Iterable, Iterator

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

BOS, EOS, PAD = "<|endoftext|>", "<|im_end|>", "<|pad|>"
IM_START = "<|im_start|>"
SPECIAL_TOKENS = [BOS, PAD, IM_START, EOS]

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['role'] == 'assistant' %}"
    "{%- generation %}{{- message['content'] + '<|im_end|>' }}{%- endgeneration %}{{- '\\n' }}"
    "{%- else %}"
    "{{- message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def train_tokenizer(texts: Iterable[str], vocab_size: int = 512, model_max_length: int = 32768
                    ) -> PreTrainedTokenizerFast:
    """Train on `texts` (message contents; see `conversation_texts`). Save it with `save_pretrained`."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte stays encodable
        show_progress=False,
    )
    # Role names and the template's newlines are part of every rendered sequence.
    tok.train_from_iterator(_with_roles(texts), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS, eos_token=EOS, pad_token=PAD,
        additional_special_tokens=[IM_START],
        chat_template=CHAT_TEMPLATE,
        model_max_length=model_max_length,
        padding_side="left",  # GRPO batches prompts left-padded; SFT collators set their own side
    )


def conversation_texts(dataset) -> Iterator[str]:
    """The message contents of a conversational dataset (`prompt`/`completion` or `messages` columns), and the
    `text` of a plain one (Zoology-format MQAR's code sequences)."""
    for row in dataset:
        if row.get("text"):
            yield row["text"]
        for column in ("prompt", "completion", "messages"):
            for message in row.get(column) or []:
                yield message["content"]


def _with_roles(texts: Iterable[str]) -> Iterator[str]:
    yield "system\nuser\nassistant\n"
    yield from texts
