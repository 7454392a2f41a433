"""Reward functions the tests load by import path, as a user's plugin would be."""


def digit_fraction(sample, response: str, answer, **metadata) -> float:
    """Share of the response's characters that are digits: dense, so tiny random policies get a signal."""
    return sum(c.isdigit() for c in response) / max(len(response), 1)


def always_fails(sample, response: str, answer, **metadata) -> float:
    raise RuntimeError("this reward function always fails")


def mixed_or_zero(sample, response: str, answer, **metadata) -> float:
    """Groups of prompts answered "mixed" score 0/1 by sample index (never all alike); the others always 0."""
    return float(sample.index % 2) if answer == "mixed" else 0.0


def odd_last_token(sample, response: str, answer, **metadata) -> float:
    """1 when the response's last token id is odd: a pass/fail that depends on what was generated."""
    return float(bool(sample.response_ids) and sample.response_ids[-1] % 2 == 1)


def hangs_or_raises(sample, response: str, answer, **metadata) -> float:
    """A faulty user reward: hangs on every 11th sample, raises on every 7th, else digit_fraction."""
    if sample.index % 11 == 3:
        import time

        time.sleep(3600)
    if sample.index % 7 == 5:
        raise ValueError(f"reward crashed on sample {sample.index}")
    return digit_fraction(sample, response, answer)


def slow_pass(sample, response: str, answer, **metadata) -> float:
    """1 after a second: a call past a shorter rollout.reward_timeout_s scores 0."""
    import time

    time.sleep(1.0)
    return 1.0
