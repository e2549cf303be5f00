"""The shared prompt template: SFT, GRPO and eval all ask the same question the same way.

This is the one place to change it: the wording below, read at call time, and the tokenizer's own chat
template, applied by `prompt_token_ids` (eval, the GRPO length filter and parity probe) or by TRL (SFT and GRPO
rollouts, from the same messages). A problem given as text becomes `build_prompt`'s messages; one given as chat
messages (a dataset's `messages` column, a prompt column of turns) goes through `instruct`, the same template.
"""
import os

INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
SYSTEM_PROMPT: str | None = None  # None: no system turn


def build_prompt(problem: str) -> list[dict]:
    """The chat messages for one problem (TRL's conversational prompt format)."""
    return instruct([{"role": "user", "content": problem}])


def instruct(messages: list[dict]) -> list[dict]:
    """`messages` in the shared template: the instruction ends the last user turn (unless it ends it already) and
    the system turn, when there is one, comes first (unless the messages have their own)."""
    messages = [dict(m) for m in messages]
    users = [i for i, m in enumerate(messages) if m["role"] == "user"]
    if users and not messages[users[-1]]["content"].rstrip().endswith(INSTRUCTION):
        last = messages[users[-1]]
        last["content"] = f"{last['content'].strip()}\n{INSTRUCTION}"
    if SYSTEM_PROMPT and not (messages and messages[0]["role"] == "system"):
        messages.insert(0, {"role": "system", "content": SYSTEM_PROMPT})
    return messages


def prompt_token_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of `messages` under the tokenizer's chat template, ending with the assistant turn's opening."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the tokenizer has no chat template; set `chat_template` in tokenizer_config.json "
                         "(prompts are chat messages, see tasks/prompts.py)")
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                              return_dict=False))


REASONING_PROBE = "reasoning-probe 17 + 25 = 42"


def sft_template_problem(tokenizer) -> str | None:
    """Why SFT with this tokenizer's chat template would not train on the whole assistant turn, or None.

    TRL's SFT renders the prompt (ending with the generation prompt) and the prompt with its completion, and trains
    on what the second adds to the first. A template that drops the reasoning of an assistant turn (DeepSeek-R1
    distills keep only the text after `</think>`) leaves the reasoning out of training; one whose assistant turn
    does not start with its own generation prompt (an R1 template that opens generation with `<think>`) makes the
    completion tokens something else than what the model generates."""
    if not getattr(tokenizer, "chat_template", None):
        return "has no chat template (prompts and completions are chat messages, see tasks/prompts.py)"
    prompt = build_prompt("What is 17 + 25?")
    turn = [{"role": "assistant", "content": f"<think>\n{REASONING_PROBE}\n</think>\n\nThe answer is 42."}]
    head = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
    full = tokenizer.apply_chat_template(prompt + turn, tokenize=False)
    if REASONING_PROBE not in full:
        return ("drops the reasoning of an assistant turn (the text up to </think>, as DeepSeek-R1-distill templates "
                "do): SFT would train on the final answers only")
    if not full.startswith(head):
        same = len(os.path.commonprefix([head, full]))
        return (f"ends the generation prompt with {head[same:]!r} where an assistant turn has {full[same:][:40]!r}: "
                "SFT would train on other tokens than the model generates after the prompt")
    return None
