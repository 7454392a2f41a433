"""Reward functions the tests load by import path, as a user's plugin would be."""


def digit_fraction(sample, response: str, answer, **metadata) -> float:
    """Share of the response's characters that are digits: dense, so tiny random policies get a signal."""
    return sum(c.isdigit() for c in response) / max(len(response), 1)


def always_fails(sample, response: str, answer, **metadata) -> float:
    raise RuntimeError("this reward function always fails")
