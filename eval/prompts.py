"""The shared prompt template: SFT, GRPO and eval all ask the same question the same way.

Minimal version written with the data loaders; the rewards/eval owner may extend it, keeping `build_prompt`.
"""
INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."


def build_prompt(problem: str) -> list[dict]:
    """The chat messages for one problem (TRL's conversational prompt format)."""
    return [{"role": "user", "content": f"{problem.strip()}\n{INSTRUCTION}"}]
