"""format: 1 when a completion ends with its boxed final answer (optionally after a think section), else 0."""
import re

from rewards.registry import register
from rewards.text import completion_text, last_boxed_span

STRUCTURES = ("boxed", "think", "think_answer")
# What may follow the closing brace of the final box: whitespace, closing math delimiters ($, \], \)),
# a full stop and markdown bold.
_TRAILER = re.compile(r"(?:\s|\$|\\\]|\\\)|\.|\*\*)*")
_ANSWER_TAGS = re.compile(r"\s*<answer>(.*)</answer>\s*", re.DOTALL)


def ends_with_box(text: str) -> bool:
    span = last_boxed_span(text)
    return span is not None and _TRAILER.fullmatch(text, span[1] + 1) is not None


def has_format(text: str, structure: str = "boxed") -> bool:
    """Whether `text` has the structure:
    "boxed":        ... \\boxed{answer}   (the box ends the text)
    "think":        [<think>] reasoning </think> ... \\boxed{answer}   (one think section, answer after it; the
                    opening tag is optional because chat templates often put it in the prompt)
    "think_answer": [<think>] reasoning </think> <answer> ... \\boxed{answer} </answer>
    """
    if structure == "boxed":
        return ends_with_box(text)
    if structure not in STRUCTURES:
        raise ValueError(f"format: unknown structure {structure!r}; choose one of {', '.join(STRUCTURES)}")
    if text.count("</think>") != 1 or text.count("<think>") > 1:
        return False
    reasoning, _, answer = text.partition("</think>")
    if "<think>" in reasoning and not reasoning.lstrip().startswith("<think>"):
        return False
    if structure == "think_answer":
        tagged = _ANSWER_TAGS.fullmatch(answer)
        if tagged is None:
            return False
        answer = tagged.group(1)
    return ends_with_box(answer)


@register("format")
def format_reward(prompts, completions, *, structure: str = "boxed", **kwargs) -> list[float]:
    """1.0 when the completion has the format `structure` (see has_format), else 0.0."""
    return [1.0 if has_format(completion_text(c), structure) else 0.0 for c in completions]
