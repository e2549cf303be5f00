"""overlong_penalty: DAPO's soft length penalty (Yu et al. 2025, "DAPO", section 3.4).

With L_max the generation limit and B the buffer, a completion of L tokens gets
    0                      if L <= L_max - B
    (L_max - B - L) / B    if L_max - B < L <= L_max   (linear from 0 down to -1)
    -1                     if L > L_max
so the policy learns to finish before the limit instead of being cut off mid-answer.
"""
import logging

from rewards.registry import register
from rewards.text import completion_text

logger = logging.getLogger(__name__)
_warned_estimate = False


@register("overlong_penalty")
def overlong_penalty(prompts, completions, completion_ids=None, *, max_length: int, buffer: int | None = None,
                     chars_per_token: float = 4.0, **kwargs) -> list[float]:
    """`max_length`: the generation limit in tokens (GRPO's max_completion_length). `buffer`: length of the
    penalty ramp in tokens (default max_length // 5, DAPO's 4096 of 20480). Lengths come from TRL's
    `completion_ids`; without them (outside TRL) they are estimated as characters / `chars_per_token`."""
    global _warned_estimate
    buffer = max_length // 5 if buffer is None else buffer
    if not 0 < buffer <= max_length:
        raise ValueError(f"overlong_penalty: buffer must be in (0, max_length={max_length}], got {buffer}")
    if completion_ids is not None:
        lengths = [len(ids) for ids in completion_ids]
    else:
        if not _warned_estimate:
            _warned_estimate = True
            logger.warning("overlong_penalty: no completion_ids given; estimating token counts as characters / %s",
                           chars_per_token)
        lengths = [len(completion_text(c)) / chars_per_token for c in completions]
    start = max_length - buffer
    return [0.0 if n <= start else -1.0 if n > max_length else (start - n) / buffer for n in lengths]
