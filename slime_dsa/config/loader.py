"""Load a recipe: YAML files that inherit through `defaults:`, `--set key=value` overrides, and validation
errors turned into one line that says which file (and line) or flag set the offending key.

While files merge, `origins` maps each key path (a tuple of keys and list indices) to where its value was
set: "recipes/x.yaml:12" or "command line (--set a.b=1)". Keys left at their schema default have none.
"""

from __future__ import annotations

import copy
import os
import re
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from slime_dsa.config.errors import RecipeError, RecipeValueError
from slime_dsa.config.introspect import (
    KeyPath,
    as_model,
    closest_name,
    field_at,
    key_path,
    list_item,
    model_at,
    range_text,
    schema_paths,
)
from slime_dsa.config.schema import RecipeConfig

Origins = dict[KeyPath, str]  # key path -> "file:line" or "command line (--set ...)"

_STR_TAG = "tag:yaml.org,2002:str"
_MERGE_TAG = "tag:yaml.org,2002:merge"


class _Loader(yaml.SafeLoader):
    """yaml.SafeLoader that also reads `1e-6` as a float (YAML 1.2); plain YAML 1.1 makes it a string."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"), list("-+0123456789"))


# ---------------------------------------------------------------------------------------------- public API


def load_recipe(path: str | os.PathLike | None = None, overrides: Sequence[str] = ()) -> RecipeConfig:
    """Read a recipe file (null = all defaults), apply `key=value` overrides in order, and validate."""
    data, origins = _read_file(Path(path)) if path is not None else ({}, {})
    for item in overrides:
        apply_override(data, origins, item)
    return validate_recipe(data, origins)


def apply_override(data: dict, origins: Origins, item: str) -> None:
    """Set one `a.b.c=value` override into a raw recipe dict; the value is parsed as YAML."""
    where = f"command line (--set {item})"
    key, sep, raw = item.partition("=")
    key = key.strip()
    if not sep or not key:
        raise RecipeError(f"{where}: expected KEY=VALUE, e.g. --set rollout.temperature=0.7")
    parts = key.split(".")
    if "" in parts:
        raise RecipeError(f"{where}: '{key}' has an empty part; keys look like rollout.sglang.tp")
    if parts[0] == "defaults":
        raise RecipeError(f"{where}: defaults can only be given in a recipe file")
    try:
        value = yaml.load(raw, Loader=_Loader)  # noqa: S506 (_Loader is a SafeLoader)
    except yaml.YAMLError as exc:
        raise RecipeError(f"{where}: {key}: the value is not valid YAML ({_yaml_problem(exc)})") from None
    path = _set_path(data, parts, value, where)
    _replace_origins(origins, path, dict(_value_origins(value, path, where)))


def validate_recipe(data: Mapping[str, Any], origins: Origins | None = None) -> RecipeConfig:
    """Validate a raw recipe dict; a problem raises RecipeError naming the key and where it was set."""
    data = _empty_sections(copy.deepcopy(dict(data)), RecipeConfig)
    try:
        return RecipeConfig.model_validate(data)
    except ValidationError as exc:
        raise _recipe_error(exc, origins or {}) from None


def dump_recipe(config: RecipeConfig) -> str:
    """The resolved recipe as YAML; loading it again gives the same config."""
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False, allow_unicode=True)


# ------------------------------------------------------------------------------------------ reading files


def _read_file(path: Path, referenced_by: str | None = None, chain: tuple[Path, ...] = ()) -> tuple[dict, Origins]:
    """One recipe file merged over the files its `defaults:` names (recursively)."""
    shown = _show_path(path)
    if not path.is_file():
        where = f"{referenced_by}: defaults: " if referenced_by else ""
        raise RecipeError(f"{where}recipe file {shown} {'is a directory' if path.is_dir() else 'not found'}")
    resolved = path.resolve()
    if resolved in chain:
        cycle = " -> ".join(_show_path(p) for p in (*chain, resolved))
        raise RecipeError(f"{shown}: defaults form a cycle: {cycle}")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise RecipeError(f"{shown}: cannot read the recipe ({exc})") from None
    data, origins = _parse_yaml(text, shown)

    base: dict = {}
    base_origins: Origins = {}
    parents = data.pop("defaults", None)
    where = origins.pop(("defaults",), shown)
    _replace_origins(origins, ("defaults",), {})
    for ref in _defaults_list(parents, where):
        sub, sub_origins = _read_file(path.parent / Path(ref).expanduser(), where, (*chain, resolved))
        _merge(base, base_origins, sub, sub_origins)
    _merge(base, base_origins, data, origins)
    return base, base_origins


def _parse_yaml(text: str, shown: str) -> tuple[dict, Origins]:
    loader = _Loader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return {}, {}
        if not isinstance(node, yaml.MappingNode):
            kind = "list" if isinstance(node, yaml.SequenceNode) else f"single value ({node.value})"
            raise RecipeError(f"{shown}: a recipe must be a mapping of sections (model:, data:, rollout:, ...), "
                              f"got a {kind}")
        origins: Origins = {}
        _record_origins(node, (), shown, origins)
        data = loader.construct_document(node)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
        line = f":{mark.line + 1}" if mark is not None else ""
        raise RecipeError(f"{shown}{line}: malformed YAML: {_yaml_problem(exc)}") from None
    finally:
        loader.dispose()
    return _empty_sections(data, RecipeConfig), origins


def _record_origins(node: yaml.Node, path: KeyPath, shown: str, origins: Origins) -> None:
    """Note the file and line of every key and list item; reject duplicate and non-string keys."""
    if isinstance(node, yaml.MappingNode):
        first_line: dict[str, int] = {}
        for key_node, value_node in node.value:
            if key_node.tag == _MERGE_TAG:  # `<<: *anchor`; its keys keep the anchor's lines unrecorded
                continue
            line = key_node.start_mark.line + 1
            if key_node.tag != _STR_TAG:
                raise RecipeError(f"{shown}:{line}: {_dotted(path) or 'top level'}: keys must be strings, got "
                                  f"{key_node.value}")
            name = key_node.value
            if name in first_line:
                raise RecipeError(f"{shown}:{line}: {_dotted((*path, name))}: duplicate key (first set on line "
                                  f"{first_line[name]})")
            first_line[name] = line
            origins[(*path, name)] = f"{shown}:{line}"
            _record_origins(value_node, (*path, name), shown, origins)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            origins[(*path, i)] = f"{shown}:{item.start_mark.line + 1}"
            _record_origins(item, (*path, i), shown, origins)


def _defaults_list(parents: Any, where: str) -> list[str]:
    if parents is None:
        return []
    if isinstance(parents, str):
        return [parents]
    if isinstance(parents, list) and all(isinstance(p, str) for p in parents):
        return parents
    raise RecipeError(f"{where}: defaults: expected a file path or a list of file paths, got {show_value(parents)}")


def _merge(dst: dict, dst_origins: Origins, src: dict, src_origins: Origins, prefix: KeyPath = ()) -> None:
    """Deep-merge src into dst: mappings merge key by key, anything else (lists included) replaces."""
    for key, value in src.items():
        path = (*prefix, key)
        if isinstance(value, dict) and isinstance(dst.get(key), dict):
            _merge(dst[key], dst_origins, value, src_origins, path)
            if path in src_origins:
                dst_origins[path] = src_origins[path]
        else:
            dst[key] = value
            _replace_origins(dst_origins, path, src_origins)


def _replace_origins(origins: Origins, path: KeyPath, new: Origins) -> None:
    """Forget the origins at and under `path`, then take those of `new` at and under it."""
    n = len(path)
    for key in [k for k in origins if k[:n] == path]:
        del origins[key]
    origins.update({k: v for k, v in new.items() if k[:n] == path})


# --------------------------------------------------------------------------------------------- overrides


def _set_path(data: dict, parts: list[str], value: Any, where: str) -> KeyPath:
    """Put value at the dotted parts (creating sections, indexing lists); return the path with list indices."""
    path: list[str | int] = []
    node: Any = data
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        if isinstance(node, list):
            if not part.isdigit() or int(part) > len(node):
                given = "is not an index" if not part.isdigit() else "is past its end"
                raise RecipeError(f"{where}: {_dotted(path)} is a list of {len(node)} item(s) and '{part}' {given}; "
                                  f"index it with 0 to {len(node)} ({len(node)} appends)")
            key: str | int = int(part)
            if key == len(node):
                node.append(None)
        elif isinstance(node, dict):
            key = part
        else:
            raise RecipeError(f"{where}: {_dotted(path)} is {show_value(node)}, not a section with a key '{part}'")
        path.append(key)
        if last:
            node[key] = value
        else:
            current = node[key] if isinstance(node, list) else node.get(key)
            if current is None:
                node[key] = _default_container(tuple(path))
            node = node[key]
    return tuple(path)


def _default_container(path: KeyPath) -> Any:
    """What an override descends into where the recipe has nothing: the schema's default list, or a section."""
    field = field_at(path)
    if field is not None and list_item(field.annotation) is not None:
        default = field.get_default(call_default_factory=True)
        return [x.model_dump(exclude_unset=True) if isinstance(x, BaseModel) else x for x in default]
    return {}


def _value_origins(value: Any, path: KeyPath, where: str) -> Iterator[tuple[KeyPath, str]]:
    yield path, where
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, sub in items:
        yield from _value_origins(sub, (*path, key), where)


# -------------------------------------------------------------------------------------------- validation


def _recipe_error(exc: ValidationError, origins: Origins) -> RecipeError:
    """All problems of a ValidationError as one line: the first in full, the others by key."""
    problems: list[tuple[str, str]] = []  # (key, line)
    errors = exc.errors()
    for err in errors:
        path = key_path(err["loc"])
        key = _dotted(path)
        if any(k == key for k, _ in problems):  # a union reports each of its members
            continue
        members = [e["type"] for e in errors if key_path(e["loc"]) == path]
        if len(members) > 1 and all(m in _EXPECTED for m in members):  # no member of a union of types took it
            expected = list(dict.fromkeys(_EXPECTED[m] for m in members))
            err = {**err, "msg": f"expected {', '.join(expected[:-1])} or {expected[-1]}", "type": "union"}
        problems.append((key, _problem_line(err, path, origins)))
    message = problems[0][1]
    if len(problems) > 1:
        others = ", ".join(k or "top level" for k, _ in problems[1:])
        message += f" (and {len(problems) - 1} more: {others})"
    return RecipeError(message)


def _problem_line(err: Mapping[str, Any], path: KeyPath, origins: Origins) -> str:
    key = _dotted(path)
    error = err.get("ctx", {}).get("error")
    if err["type"] == "value_error" and isinstance(error, RecipeValueError) and error.keys:
        full = [(*path, *k.split(".")) for k in error.keys]
        full = [tuple(int(p) if isinstance(p, str) and p.isdigit() else p for p in f) for f in full]
        where = ", ".join(dict.fromkeys(origins[f] for f in full if f in origins)) or _nearest_origin(path, origins)
    else:
        where = _nearest_origin(path, origins)
    parts = [p for p in (where, key) if p]
    return ": ".join([*parts, _describe(err, path)])


def _nearest_origin(path: KeyPath, origins: Origins) -> str:
    """Where the key, else its closest enclosing key, else the first key under it, was set."""
    for n in range(len(path), 0, -1):
        if path[:n] in origins:
            return origins[path[:n]]
    return next((v for k, v in origins.items() if path and k[: len(path)] == path), "")


_EXPECTED = {
    "float_type": "a number", "float_parsing": "a number", "finite_number": "a finite number",
    "int_type": "an integer", "int_parsing": "an integer", "int_from_float": "an integer",
    "bool_type": "true or false", "bool_parsing": "true or false", "string_type": "a string",
    "list_type": "a list", "tuple_type": "a list", "dict_type": "a mapping",
    "model_type": "a mapping of keys (a section)", "model_attributes_type": "a mapping of keys (a section)",
}
_BOUNDS = {"greater_than", "greater_than_equal", "less_than", "less_than_equal"}


def _describe(err: Mapping[str, Any], path: KeyPath) -> str:
    """What was wrong with the value, in the recipe's words rather than pydantic's."""
    kind, ctx, got = err["type"], err.get("ctx", {}), show_value(err.get("input"))
    if kind == "extra_forbidden":
        return "unknown key" + _suggest(path)
    if kind == "value_error" and "error" in ctx:
        return str(ctx["error"])
    if kind == "union":
        return f"{err['msg']}, got {got}"
    if kind == "literal_error":
        return f"expected one of {ctx['expected']}, got {got}"
    if kind in _EXPECTED:
        return f"expected {_EXPECTED[kind]}, got {got}"
    if kind in _BOUNDS:
        field = field_at(path)
        return f"must be {range_text(field) if field else err['msg'].removeprefix('Input should be ')}, got {got}"
    if kind == "missing":
        past = err["loc"][len(path):]  # an index past the key: an item of a fixed-length list (adam_betas)
        if past and isinstance(past[-1], int):
            return f"too few items: item {past[-1]} is missing"
        return "required key is missing"
    return f"{err['msg'][:1].lower()}{err['msg'][1:]}, got {got}"


def _suggest(path: KeyPath) -> str:
    """', did you mean a.b?' for the closest valid key: the same name in another section, a close name in
    this section, a close name anywhere; else the keys that are valid here."""
    parent, name = path[:-1], str(path[-1])
    model = model_at(parent)
    here = list(model.model_fields) if model else []
    everywhere = {p[-1]: _dotted(p) for p in reversed(list(schema_paths()))}  # first path per name
    if name in everywhere:
        return f", did you mean {everywhere[name]}?"
    match = closest_name(name, here, cutoff=0.6)
    if match:
        return f", did you mean {_dotted((*parent, match))}?"
    match = closest_name(name, everywhere, cutoff=0.75)
    if match:
        return f", did you mean {everywhere[match]}?"
    if here and len(here) <= 10:
        return f"; valid keys here: {', '.join(here)}"
    section = _dotted([p for p in parent if isinstance(p, str)])
    return f"; see `slime-dsa recipe explain {section}`"


def _empty_sections(data: Any, model: type[BaseModel]) -> Any:
    """Read a null section (`rollout:` with everything under it commented out) as an empty one; a section whose
    default is null (data.tasks.<i>.agent) stays null."""
    if not isinstance(data, dict):
        return data
    for key, value in data.items():
        field = model.model_fields.get(key) if isinstance(key, str) else None
        if field is None:
            continue
        sub, item = as_model(field.annotation), as_model(list_item(field.annotation))
        if sub is not None and not (value is None and field.default is None):
            data[key] = _empty_sections({} if value is None else value, sub)
        elif item is not None and isinstance(value, list):
            data[key] = [_empty_sections({} if v is None else v, item) for v in value]
    return data


# ---------------------------------------------------------------------------------------------- rendering


def show_value(value: Any) -> str:
    """A value as the user wrote it in YAML: null, true, 'text', [1, 2]."""
    if value is None or isinstance(value, bool):
        return {None: "null", True: "true", False: "false"}[value]
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _dotted(path: Sequence[str | int]) -> str:
    return ".".join(str(p) for p in path)


def _show_path(path: Path) -> str:
    rel = os.path.relpath(path)
    return rel if not rel.startswith("..") else str(path)


def _yaml_problem(exc: yaml.YAMLError) -> str:
    return str(getattr(exc, "problem", None) or exc).strip()


__all__ = ["KeyPath", "Origins", "apply_override", "dump_recipe", "load_recipe", "validate_recipe"]
