"""The base of every recipe section, apart so that section modules beside schema.py (teachers.py) can use it."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    """Base of every recipe section: unknown keys are errors and values are not coerced between types
    (so `num_steps: 1.5` or `mixed_precision: "yes"` fail instead of being silently converted)."""

    model_config = ConfigDict(extra="forbid", strict=True)
