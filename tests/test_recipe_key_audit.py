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
