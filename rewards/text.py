"""Text helpers shared by the rewards and the evaluation: completion text and the final boxed answer."""

import re

_BOX_COMMANDS = ("\\boxed", "\\fbox")
# An escape sequence (\{ \} \\ ...) is one token, so escaped braces never count as nesting.
_BRACE_TOKENS = re.compile(r"\\.|[{}]", re.DOTALL)


def completion_text(completion) -> str:
    """The text of one completion: a string, or TRL's conversational form (a list of chat messages)."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list):
        parts = []
        for message in completion:
            content = message.get("content") if isinstance(message, dict) else None
            if isinstance(content, str):
                parts.append(content)
            elif isinstance(content, list):  # multimodal form: [{"type": "text", "text": ...}, ...]
                parts.extend(p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
        return "".join(parts)
    raise TypeError(f"a completion must be a string or a list of chat messages, got {type(completion).__name__}")


def last_boxed_span(text: str) -> tuple[int, int] | None:
    """(start, end) of the content of the last `\\boxed{...}` / `\\fbox{...}` in `text`, braces excluded.

    Only the last box counts: when it is unbalanced (a completion cut off mid-answer) there is no answer,
    even if an earlier box is complete. Escaped braces `\\{ \\}` (LaTeX sets) do not count as nesting.
    Linear in the length of the text after the box, so megabyte completions are cheap.
    """
    command_end = -1
    for command in _BOX_COMMANDS:
        pos = text.rfind(command)
        while pos != -1 and text[pos + len(command):pos + len(command) + 1].isalpha():
            pos = text.rfind(command, 0, pos)  # `\boxedfoo` is another command
        if pos != -1:
            command_end = max(command_end, pos + len(command))
    if command_end == -1:
        return None
    i = command_end
    while i < len(text) and text[i].isspace():
        i += 1
    if i == len(text) or text[i] != "{":
        return None
    depth = 0
    for token in _BRACE_TOKENS.finditer(text, i):  # regex scan: plain text is skipped at C speed
        if token.group() == "{":
            depth += 1
        elif token.group() == "}":
            depth -= 1
            if depth == 0:
                return i + 1, token.start()
    return None


def last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` (see `last_boxed_span`), stripped; None when there is none."""
    span = last_boxed_span(text)
    if span is None:
        return None
    content = text[span[0]:span[1]].strip()
    return content or None
