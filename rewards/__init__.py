"""Reward functions for GRPO and grading for evaluation (see docs/rewards-and-eval.md).

Importing the package registers the built-ins: math_accuracy, format, overlong_penalty, retrieval_accuracy.
"""
from rewards import accuracy, format, length, retrieval  # noqa: F401 (registers the built-in rewards)
from rewards.accuracy import grade, math_accuracy
from rewards.registry import (
    FailureLimit,
    RewardsFailing,
    SafeReward,
    build_reward,
    build_rewards,
    failure_counts,
    get_reward,
    record_failure,
    register,
    registered,
    reset_failure_counts,
)
from rewards.text import completion_text, last_boxed

__all__ = [
    "FailureLimit", "RewardsFailing", "SafeReward", "build_reward", "build_rewards", "completion_text",
    "failure_counts", "get_reward", "grade", "last_boxed", "math_accuracy", "record_failure", "register", "registered",
    "reset_failure_counts",
]
