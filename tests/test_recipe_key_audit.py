"""Recipe keys that were accepted and then ignored (or refused only after Ray started) in some combination of
loop, engine and section: `recipe check` refuses each in one line naming the key."""

from __future__ import annotations

import pytest

from slime_dsa.config import RecipeError, validate_recipe

EXTERNAL = {"engine": "external", "engine_urls": ["http://127.0.0.1:30000"]}


def refusal(data: dict) -> str:
    """The one-line RecipeError that validate_recipe raises for `data`."""
    with pytest.raises(RecipeError) as info:
        validate_recipe(data)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_num_engines_with_external_engines_is_refused():
    """engine external uses one engine per URL: rollout.num_engines 4 was accepted and ignored."""
    message = refusal({"rollout": {**EXTERNAL, "num_engines": 4}})
    assert "rollout: num_engines (4) counts the engines the run starts" in message and "engine_urls" in message
    assert validate_recipe({"rollout": {**EXTERNAL}}).rollout.num_engines == 1


@pytest.mark.parametrize("key, value", [("oversample_factor", 1.5), ("max_oversample_factor", 2.0),
                                        ("max_sampling_tries", 8)])
def test_sampling_round_keys_under_the_asynchronous_loop_are_refused(key, value):
    """The asynchronous loop replaces each dropped group as it goes, in no rounds: these keys of the synchronous
    loop's dynamic-sampling rounds were accepted and ignored by async_reinforce."""
    data = {"rollout": {"dynamic_sampling": True, key: value}, "algorithm": {"name": "async_reinforce"}}
    message = refusal(data)
    assert f"rollout.{key} ({value}) sizes the synchronous loop's sampling rounds" in message
    assert "algorithm 'async_reinforce' runs the asynchronous one" in message
    assert validate_recipe({**data, "algorithm": {"name": "grpo"}}).rollout.dynamic_sampling  # the synchronous loop
    validate_recipe({**data, "rollout": {"dynamic_sampling": True}})  # dynamic sampling itself: both loops
