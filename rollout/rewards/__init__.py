"""Reward functions: built-in verifiers (arithmetic, countdown, sort, math-verify), custom ones by import path, and
`compute_reward`, which scores a sample without ever raising. The calling contract is in `registry`."""

from rollout.rewards.answer import answer_text, extract_tagged, last_number
from rollout.rewards.arithmetic import arithmetic_reward
from rollout.rewards.compute import RewardResult, RewardStats, compute_reward
from rollout.rewards.countdown import countdown_reward
from rollout.rewards.math_verifier import MathVerifyPool, MathVerifyTimeout, math_verify_reward, verify_math
from rollout.rewards.registry import (
    RewardFunction,
    RewardLoadError,
    available_rewards,
    load_reward_fn,
    register_reward,
)
from rollout.rewards.sort import sort_reward

__all__ = [
    "MathVerifyPool",
    "MathVerifyTimeout",
    "RewardFunction",
    "RewardLoadError",
    "RewardResult",
    "RewardStats",
    "answer_text",
    "arithmetic_reward",
    "available_rewards",
    "compute_reward",
    "countdown_reward",
    "extract_tagged",
    "last_number",
    "load_reward_fn",
    "math_verify_reward",
    "register_reward",
    "sort_reward",
    "verify_math",
]
