"""Recipes: the pydantic schema of a run's configuration, YAML loading with `defaults:` inheritance and
`--set` overrides, and errors that name the key and the file (or flag) that set it."""

from slime_dsa.config.errors import RecipeError, RecipeValueError, UserError
from slime_dsa.config.explain import defaults_yaml, explain
from slime_dsa.config.loader import apply_override, dump_recipe, load_recipe, validate_recipe
from slime_dsa.config.schema import (
    AlgorithmSection,
    CheckpointSection,
    ClusterSection,
    DataSection,
    LoggingSection,
    ModelSection,
    RecipeConfig,
    RolloutSection,
    SGLangSection,
    TaskConfig,
    TrainerSection,
)

__all__ = [
    "AlgorithmSection", "CheckpointSection", "ClusterSection", "DataSection", "LoggingSection", "ModelSection",
    "RecipeConfig", "RecipeError", "RecipeValueError", "RolloutSection", "SGLangSection", "TaskConfig",
    "TrainerSection", "UserError", "apply_override", "defaults_yaml", "dump_recipe", "explain", "load_recipe",
    "validate_recipe",
]
