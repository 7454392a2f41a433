"""Render the recipe schema for people: `explain()` lists every key with its type, default and description (of the
whole recipe, one section, or the keys one algorithm reads); `defaults_yaml()` writes every default as a commented
recipe (recipes/base.yaml is its output)."""

from __future__ import annotations

import importlib
import textwrap
import types
from typing import Any, Literal, Union, get_args, get_origin

import yaml
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from slime_dsa.algorithms.specs import ALGORITHMS, COMMON_OPTIONS
from slime_dsa.config.errors import RecipeError
from slime_dsa.config.introspect import as_model, closest_name, list_item, range_text, sections
from slime_dsa.config.schema import AlgorithmSection, RecipeConfig

_WIDTH = 100
_DEFAULTS_KEY = ("defaults", "str | list[str] = null",
                 "Recipe file(s) this one inherits from, relative to this file; this file's keys win, lists are "
                 "replaced, and later files in the list win over earlier ones.")


def explain(section: str | None = None) -> str:
    """Every key of the recipe (or of one section, or the keys of one algorithm: `explain("sao")`) with its type,
    default and description."""
    known = sections()
    if section is None:
        intro = ("A recipe is a YAML mapping of the sections below; every key is optional. "
                 "Override any key on the command line with --set SECTION.KEY=VALUE (VALUE is YAML).")
        key, kind, text = _DEFAULTS_KEY
        lines = [*textwrap.wrap(intro, _WIDTH), "", f"  {key}: {kind}", *_wrap(text, 6), ""]
        for name in RecipeConfig.model_fields:
            lines += _render_section(name, *known[name])
        return "\n".join(lines).rstrip() + "\n"
    if section in ALGORITHMS and section not in known:
        return explain_algorithm(section)
    if section not in known:
        match = closest_name(section, [*known, *ALGORITHMS], cutoff=0.6)
        hint = f"did you mean {match}? " if match else ""
        raise RecipeError(f"recipe explain: unknown section '{section}'; {hint}sections: {', '.join(known)}; "
                          f"algorithms: {', '.join(ALGORITHMS)}")
    return "\n".join(_render_section(section, *known[section])).rstrip() + "\n"


def explain_algorithm(name: str) -> str:
    """What one algorithm is and every key it reads: its own keys of the algorithm section, then the sections of the
    model roles it adds (a critic's) or the teachers it reads, each with type, default and description (which names
    the default's source)."""
    spec = ALGORITHMS[name]
    doc = (spec.__doc__ or "").strip().splitlines()[0]
    module = (importlib.import_module(spec.__module__).__doc__ or "").strip()
    lines = [f"{name}: {doc}", *(f"  {line}".rstrip() for line in module.splitlines()),
             f"  loop: {spec.loop}; advantages: {spec.advantage_source}, one per {spec.advantage_level}; model roles: "
             f"{', '.join(spec.roles)}; smallest group: {spec.min_group_size}", "",
             f"algorithm: the keys {name} reads beside those every algorithm reads (recipe explain algorithm)",
             f"  algorithm.name: {name}"]
    for key, field in AlgorithmSection.model_fields.items():
        if key in spec.options and key not in COMMON_OPTIONS:
            lines += _render_key("algorithm", key, field)
    lines.append("")
    if "critic" in spec.roles:  # the role's own section: its weights, optimiser and placement
        lines += _render_section("critic", *sections()["critic"])
    if spec.advantage_source == "teacher":  # the models whose log-probs make the advantages
        lines += _render_section("teachers", *sections()["teachers"])
    lines.append("The policy's optimiser is the trainer section's (trainer.learning_rate, ...): recipe explain trainer.")
    return "\n".join(lines).rstrip() + "\n"


def _render_key(prefix: str, key: str, field: FieldInfo) -> list[str]:
    """`  prefix.key: type = default  (range)` (`type, required` for a key of a list item that has no default) and
    the wrapped description."""
    bounds = range_text(field)
    value = ", required" if field.is_required() else f" = {_inline(_default(field))}"
    return [f"  {prefix}.{key}: {_type_text(field.annotation)}{value}" + (f"  ({bounds})" if bounds else ""),
            *_wrap(field.description or "", 6)]


def _render_section(name: str, model: type[BaseModel], prefix: str) -> list[str]:
    """A header, then each key: `  key: type = default  (range)` and its wrapped description."""
    doc = (model.__doc__ or "").strip().splitlines()[0]
    lines = [f"{name}: {doc}"]
    subsections = []
    for key, field in model.model_fields.items():
        sub, item = as_model(field.annotation), as_model(list_item(field.annotation))
        if sub is not None or item is not None:
            subsections.append(key)
            kind = "section" if sub else f"list of sections = {_inline(_default(field))}"
            lines.append(f"  {prefix}.{key}: {kind}, see {_join(name, key)} below")
            lines += _wrap(field.description or "", 6)
        else:
            lines += _render_key(prefix, key, field)
    lines.append("")
    for key in subsections:
        sub_name = _join(name, key)
        lines += _render_section(sub_name, *sections()[sub_name])
    return lines


def defaults_yaml() -> str:
    """Every key at its default as a YAML recipe, each key under a comment with its description."""
    header = [
        "# Every key of a recipe at its default value, with what it means. Generated by",
        "# `slime-dsa recipe explain --yaml`; an empty recipe means the same.",
        "# Start a recipe with `defaults: base.yaml` and set only what differs;",
        "# override any key from the command line with `--set section.key=value`.",
        "",
    ]
    return "\n".join(header + _yaml_lines(RecipeConfig(), 0)) + "\n"


def _yaml_lines(config: BaseModel, indent: int) -> list[str]:
    pad = " " * indent
    lines: list[str] = []
    for key, field in type(config).model_fields.items():
        value = getattr(config, key)
        if indent == 0 and lines:
            lines.append("")
        literal = next((a for a in (field.annotation, *get_args(field.annotation)) if get_origin(a) is Literal), None)
        choices = get_args(literal) if literal is not None else ()  # through `Literal[...] | None` too
        comment = (field.description or "") + (f" [{' | '.join(map(str, choices))}]" if choices else "")
        if indent == 0 and isinstance(value, BaseModel):  # a section's docstring says more than its field description
            comment = (type(value).__doc__ or "").strip().splitlines()[0]
        lines += [f"{pad}# {line}" for line in textwrap.wrap(comment, _WIDTH - indent - 2)]
        if isinstance(value, BaseModel):
            lines += [f"{pad}{key}:", *_yaml_lines(value, indent + 2)]
        elif isinstance(value, list) and value and isinstance(value[0], BaseModel):
            lines.append(f"{pad}{key}:")
            for item in value:
                body = _yaml_lines(item, indent + 4)
                first = next(i for i, line in enumerate(body) if not line.lstrip().startswith("#"))
                body[:first] = [f"{pad}  {line.lstrip()}" for line in body[:first]]
                body[first] = f"{pad}  - {body[first].lstrip()}"
                lines += body
        else:
            lines.append(f"{pad}{key}: {_inline(value)}")
    return lines


def _default(field: FieldInfo) -> Any:
    return field.get_default(call_default_factory=True)


def _type_text(annotation: Any) -> str:
    """A type the way a recipe writer thinks of it: 'float | null', 'a | b | c', 'list[str]'."""
    origin, args = get_origin(annotation), get_args(annotation)
    if annotation is type(None):
        return "null"
    if origin is Literal:
        return " | ".join(str(a) for a in args)
    if origin in (Union, types.UnionType):
        return " | ".join(_type_text(a) for a in args)
    if origin in (list, tuple):
        inner = ", ".join(_type_text(a) for a in args)
        return f"list[{inner}]" if origin is list else f"[{inner}]"
    return getattr(annotation, "__name__", str(annotation))


def _inline(value: Any) -> str:
    """A value in YAML flow style, on one line."""
    if isinstance(value, BaseModel):
        value = value.model_dump(mode="json", exclude_defaults=True)
    elif isinstance(value, (list, tuple)):
        value = [v.model_dump(mode="json", exclude_unset=True) if isinstance(v, BaseModel) else v for v in value]
    text = yaml.safe_dump(value, default_flow_style=True, sort_keys=False, width=10**6, allow_unicode=True)
    return text.removesuffix("\n...\n").strip()


def _wrap(text: str, indent: int) -> list[str]:
    return textwrap.wrap(text, _WIDTH, initial_indent=" " * indent, subsequent_indent=" " * indent)


def _join(prefix: str, key: str) -> str:
    return f"{prefix}.{key}" if prefix else key
