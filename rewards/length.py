"""overlong_penalty: DAPO's soft length penalty (Yu et al. 2025, "DAPO", section 3.4), as TRL implements it
(`trl.rewards.get_soft_overlong_punishment`), in this project's reward signature.

With L_max the generation limit and B the buffer, a completion of L tokens gets
    0                      if L <= L_max - B
    (L_max - B - L) / B    if L_max - B < L <= L_max   (linear from 0 down to -1)
    -1                     if L > L_max
so the policy learns to finish before the limit instead of being cut off mid-answer.
"""
import logging
import math

from trl.rewards import get_soft_overlong_punishment

from rewards.registry import register
from rewards.text import completion_text

logger = logging.getLogger(__name__)
_warned_estimate = False


@register("overlong_penalty")
def overlong_penalty(prompts, completions, completion_ids=None, *, max_length: int, buffer: int | None = None,
                     chars_per_token: float = 4.0, **kwargs) -> list[float]:
    """`max_length`: the generation limit in tokens (GRPO's max_completion_length). `buffer`: length of the
    penalty ramp in tokens (default max_length // 5, DAPO's 4096 of 20480). Lengths come from TRL's
    `completion_ids`; without them (outside TRL) they are estimated as characters / `chars_per_token`, rounded
    up."""
    global _warned_estimate
    buffer = max_length // 5 if buffer is None else buffer
    if not 0 < buffer <= max_length:
        raise ValueError(f"overlong_penalty: buffer must be in (0, max_length={max_length}], got {buffer}")
    if completion_ids is None:
        if not _warned_estimate:
            _warned_estimate = True
            logger.warning("overlong_penalty: no completion_ids given; estimating token counts as characters / %s",
                           chars_per_token)
        # TRL's reward reads only the length of each id list.
        completion_ids = [[0] * math.ceil(len(completion_text(c)) / chars_per_token) for c in completions]
    return get_soft_overlong_punishment(max_length, buffer)(completion_ids)
