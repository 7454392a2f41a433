"""GLM-style tool calls: the text a model writes to call a tool, and the token ids of the tool-result turn after it.

The layout is GLM-4.5's chat template (zai-org/GLM-4.5 chat_template.jinja; SGLang's glm45 tool parser reads it):
    <tool_call>{name}\\n<arg_key>{key}</arg_key>\\n<arg_value>{value}</arg_value>\\n</tool_call>
one `<arg_key>/<arg_value>` pair per argument, string values as they are, other values as JSON. The model ends a turn
that calls tools by sampling `<|observation|>` (a stop token in GLM's generation config); the results follow as
    <|observation|>\\n<tool_response>\\n{output}\\n</tool_response>   (one <tool_response> block per call)
and then the generation prompt of the next assistant turn. One module for both sides: the agent loop builds
observation ids with `ChatFormat` at rollout time, and SFT builds its examples with it, so a model fine-tuned on
reference trajectories sees the same ids it will meet in RL.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

OBSERVATION_TOKEN = "<|observation|>"
USER_TOKEN = "<|user|>"
_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)
_ARG = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)


@dataclass(frozen=True)
class ToolCall:
    """One parsed call: the tool's name and its arguments (values as the model wrote them, strings)."""

    name: str
    arguments: dict[str, str] = field(default_factory=dict)


def render_tool_call(name: str, arguments: Mapping[str, Any]) -> str:
    """The text of one call, as GLM-4.5's template writes it (and as `parse_tool_calls` reads it)."""
    args = "".join(f"<arg_key>{k}</arg_key>\n<arg_value>{v if isinstance(v, str) else json.dumps(v)}</arg_value>\n"
                   for k, v in arguments.items())
    return f"<tool_call>{name}\n{args}</tool_call>"


def parse_tool_calls(text: str) -> tuple[list[ToolCall], str | None]:
    """(the calls in `text`, None) or ([], why) when a `<tool_call>` is malformed; ([], None) when there is none."""
    bodies = _CALL.findall(text)
    if not bodies:
        return [], ("a <tool_call> is not closed with </tool_call>" if "<tool_call>" in text else None)
    calls = []
    for body in bodies:
        head, marker, args = body.partition("<arg_key>")
        name = head.strip()
        if not name or any(c.isspace() for c in name):
            return [], f"a <tool_call> must start with the tool's name, got {name[:40]!r}"
        pairs = _ARG.findall(marker + args)
        if _ARG.sub("", marker + args).strip():
            return [], f"tool call {name!r}: arguments must be <arg_key>k</arg_key><arg_value>v</arg_value> pairs"
        calls.append(ToolCall(name, {k.strip(): v.strip() for k, v in pairs}))
    return calls, None


@dataclass(frozen=True)
class ChatFormat:
    """The GLM token layout around tool calls for one tokenizer: stop tokens, turn ends and observation ids."""

    tokenizer: Any
    eos_id: int
    observation_id: int
    user_id: int | None
    generation_prompt: str  # what add_generation_prompt appends: "<|assistant|>\\n" for the built-in tokenizer

    @classmethod
    def from_tokenizer(cls, tokenizer: Any) -> ChatFormat:
        """Read the ids from `tokenizer`; ValueError naming the token it lacks."""
        ids = {tok: tokenizer.convert_tokens_to_ids(tok) for tok in (OBSERVATION_TOKEN, USER_TOKEN)}
        unk = getattr(tokenizer, "unk_token_id", None)
        if ids[OBSERVATION_TOKEN] in (None, unk):
            raise ValueError(f"GLM-style tool calls need the token {OBSERVATION_TOKEN} in the tokenizer's vocabulary")
        if tokenizer.eos_token_id is None:
            raise ValueError("GLM-style tool calls need a tokenizer with an eos_token")
        user = ids[USER_TOKEN] if ids[USER_TOKEN] not in (None, unk) else None
        return cls(tokenizer, tokenizer.eos_token_id, ids[OBSERVATION_TOKEN], user, _generation_prompt(tokenizer))

    @property
    def stop_token_ids(self) -> list[int]:
        """Tokens that end an assistant turn besides EOS: <|observation|> (tool results next) and <|user|>."""
        return [self.observation_id] + ([self.user_id] if self.user_id is not None else [])

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def encode_output(self, text: str) -> list[int]:
        """A tool's output as plain text: a special token written in it (<|assistant|>) is not read as one."""
        return self.tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True)

    def observation_ids(self, outputs: Sequence[str], last_model_token: int | None) -> list[int]:
        """The ids after a tool-calling turn: <|observation|> (unless the model's last token already is it), one
        <tool_response> block per output, then the next assistant turn's generation prompt."""
        ids = [] if last_model_token == self.observation_id else [self.observation_id]
        for output in outputs:
            ids += self.encode("\n<tool_response>\n") + self.encode_output(output) + self.encode("\n</tool_response>")
        return ids + self.encode(self.generation_prompt)

    def assistant_turn_ids(self, text: str) -> list[int]:
        """A reference assistant turn as the model should write it: its text, then <|observation|> if it calls a
        tool, else EOS (the built-in chat template's convention; SFT trains on these)."""
        calls, _ = parse_tool_calls(text)
        return self.encode(text) + [self.observation_id if calls else self.eos_id]


def _generation_prompt(tokenizer: Any) -> str:
    """What the chat template appends for add_generation_prompt; GLM's "<|assistant|>\\n" without a template."""
    if not getattr(tokenizer, "chat_template", None):
        return "<|assistant|>\n"
    messages = [{"role": "user", "content": "x"}]
    with_prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    without = tokenizer.apply_chat_template(messages, add_generation_prompt=False, tokenize=False)
    return with_prompt[len(without):] if with_prompt.startswith(without) else "<|assistant|>\n"


def solution_ids(turns: Sequence[Mapping[str, str]], fmt: ChatFormat) -> tuple[list[int], list[int]]:
    """(response ids, loss mask) of a reference trajectory: assistant turns (mask 1) and tool results (mask 0), each
    run of tool turns one observation; turns are {"role": "assistant" | "tool", "content": str}."""
    ids: list[int] = []
    mask: list[int] = []
    pending: list[str] = []
    for i, turn in enumerate(turns):
        role = turn.get("role")
        if role == "tool":
            pending.append(str(turn.get("content", "")))
            continue
        if role != "assistant":
            raise ValueError(f"solution turn {i}: role must be 'assistant' or 'tool', got {role!r}")
        if pending:
            obs = fmt.observation_ids(pending, ids[-1] if ids else None)
            ids, mask, pending = ids + obs, mask + [0] * len(obs), []
        turn_ids = fmt.assistant_turn_ids(str(turn.get("content", "")))
        ids, mask = ids + turn_ids, mask + [1] * len(turn_ids)
    if pending:
        raise ValueError("a solution must end with an assistant turn, not with tool output")
    return ids, mask
