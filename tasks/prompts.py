"""The shared prompt template: SFT, GRPO and eval all ask the same question the same way.

This is the one place to change it: the wording below, read at call time, and the tokenizer's own chat
template, applied by `prompt_token_ids` (eval, the GRPO length filter and parity probe) or by TRL (SFT and GRPO
rollouts, from the same `build_prompt` messages).
"""
INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
SYSTEM_PROMPT: str | None = None  # None: no system turn


def build_prompt(problem: str) -> list[dict]:
    """The chat messages for one problem (TRL's conversational prompt format)."""
    system = [{"role": "system", "content": SYSTEM_PROMPT}] if SYSTEM_PROMPT else []
    return system + [{"role": "user", "content": f"{problem.strip()}\n{INSTRUCTION}"}]


def prompt_token_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of `messages` under the tokenizer's chat template, ending with the assistant turn's opening."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the tokenizer has no chat template; set `chat_template` in tokenizer_config.json "
                         "(prompts are chat messages, see tasks/prompts.py)")
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                              return_dict=False))
