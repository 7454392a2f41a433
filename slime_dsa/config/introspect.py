"""Walking the recipe schema by key path: which section or field a path names, every path, value ranges.
Used by the loader (errors, suggestions, overrides) and by `explain`."""

from __future__ import annotations

import difflib
import types
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Union, get_args, get_origin

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from slime_dsa.config.schema import RecipeConfig

KeyPath = tuple[str | int, ...]  # keys and list indices, e.g. ("data", "tasks", 0, "weight")


def as_model(annotation: Any) -> type[BaseModel] | None:
    """The section class of a field's annotation (through `X | None`), else None."""
    if get_origin(annotation) in (Union, types.UnionType):
        args = [a for a in get_args(annotation) if a is not type(None)]
        annotation = args[0] if len(args) == 1 else None
    return annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None


def list_item(annotation: Any) -> Any:
    """The item type of a `list[X]` annotation, else None."""
    return get_args(annotation)[0] if get_origin(annotation) is list else None


def walk(path: Sequence[str | int]) -> tuple[FieldInfo | None, Any]:
    """(field, annotation) at a key path of RecipeConfig; (None, None) where the path leaves the schema."""
    field, annotation = None, RecipeConfig
    for part in path:
        model, item = as_model(annotation), list_item(annotation)
        if model is not None and isinstance(part, str) and part in model.model_fields:
            field = model.model_fields[part]
            annotation = field.annotation
        elif item is not None and isinstance(part, int):
            field, annotation = None, item
        elif get_origin(annotation) is dict and isinstance(part, str):  # a key of a mapping (data.tasks.<i>.task_args)
            field, annotation = None, get_args(annotation)[1]
        else:
            return None, None
    return field, annotation


def field_at(path: Sequence[str | int]) -> FieldInfo | None:
    """The field a key path names, or None (a section root, a list item, or not in the schema)."""
    return walk(path)[0]


def model_at(path: Sequence[str | int]) -> type[BaseModel] | None:
    """The section class a key path names, or None."""
    return as_model(walk(path)[1])


def key_path(loc: tuple[str | int, ...]) -> KeyPath:
    """The part of a pydantic error location that names recipe keys (an unknown key included)."""
    for n in range(len(loc), -1, -1):
        if walk(loc[:n])[1] is not None:
            # one step past a section is an unknown key; steps past a leaf are pydantic's union member tags
            return loc[: n + 1] if n < len(loc) and model_at(loc[:n]) is not None else loc[:n]
    return ()


def schema_paths(model: type[BaseModel] = RecipeConfig, prefix: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    """Every key path of a section, depth first; list items appear as `<i>`."""
    for name, field in model.model_fields.items():
        path = (*prefix, name)
        yield path
        sub, item = as_model(field.annotation), as_model(list_item(field.annotation))
        if sub is not None:
            yield from schema_paths(sub, path)
        elif item is not None:
            yield from schema_paths(item, (*path, "<i>"))


def sections(
    model: type[BaseModel] = RecipeConfig, name: str = "", prefix: str = ""
) -> dict[str, tuple[type[BaseModel], str]]:
    """Every section by dotted name ('rollout', 'rollout.sglang', 'data.tasks') -> (class, key prefix of its
    keys, e.g. 'data.tasks.<i>')."""
    found: dict[str, tuple[type[BaseModel], str]] = {}
    for key, field in model.model_fields.items():
        item = as_model(list_item(field.annotation))
        sub = as_model(field.annotation) or item
        if sub is None:
            continue
        sub_name = f"{name}.{key}" if name else key
        sub_prefix = (f"{prefix}.{key}" if prefix else key) + (".<i>" if item else "")
        found[sub_name] = (sub, sub_prefix)
        found.update(sections(sub, sub_name, sub_prefix))
    return found


def range_text(field: FieldInfo) -> str:
    """'in [0, 1)', '>= 0', ... from a field's numeric constraints; '' when it has none."""
    low = high = ""
    for m in field.metadata:
        if getattr(m, "gt", None) is not None:
            low = f"({m.gt:g}"
        if getattr(m, "ge", None) is not None:
            low = f"[{m.ge:g}"
        if getattr(m, "lt", None) is not None:
            high = f"{m.lt:g})"
        if getattr(m, "le", None) is not None:
            high = f"{m.le:g}]"
    if low and high:
        return f"in {low}, {high}"
    if low:
        return f"{'>' if low[0] == '(' else '>='} {low[1:]}"
    if high:
        return f"{'<' if high[-1] == ')' else '<='} {high[:-1]}"
    return ""


def closest_name(name: str, candidates: Iterable[str], cutoff: float) -> str | None:
    """The candidate key most like `name` with a score of at least `cutoff` (name_similarity), else None."""
    scored = [(name_similarity(name, c), c) for c in candidates]
    best = max(scored, default=(0.0, None), key=lambda sc: sc[0])
    return best[1] if best[0] >= cutoff else None


def name_similarity(typed: str, key: str) -> float:
    """0..1: how likely `typed` was meant as `key`. Keys are words joined by '_': words may come in another order
    or be cut short (hi: high, len: length), and a name may be the words' initials (lr: learning_rate)."""
    typed, key = typed.lower(), key.lower()
    words, key_words = [w for w in typed.split("_") if w], [w for w in key.split("_") if w]
    if len(key_words) > 1 and typed == "".join(w[0] for w in key_words):
        return 0.95
    whole = difflib.SequenceMatcher(None, typed, key).ratio()
    if not words or not key_words:
        return whole
    both = [max(_word_similarity(w, k) for k in key_words) for w in words]
    both += [max(_word_similarity(w, k) for w in words) for k in key_words]
    return max(whole, sum(both) / len(both))


def _word_similarity(a: str, b: str) -> float:
    shorter, longer = sorted((a, b), key=len)
    if len(shorter) >= 2 and longer.startswith(shorter) and shorter != longer:
        return 0.9
    return difflib.SequenceMatcher(None, a, b).ratio()
