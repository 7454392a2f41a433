"""OpenAI-compatible /v1/completions and /v1/chat/completions over the embedded engine.

Chat prompts use the chat template of the tokenizer saved with the model (`input_ids` bypasses it). Replies
are parsed the way SGLang's glm45 reasoning parser and glm47 tool-call parser do: `<think>...</think>` becomes
reasoning_content and each `<tool_call>...</tool_call>` a tool call (JSON body, or GLM's
`name<arg_key>k</arg_key><arg_value>v</arg_value>` body). Streaming is not offered here: use /generate.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
import uuid
from typing import Any

from aiohttp import web

from rollout.engine.types import GenerateRequest, RequestError
from rollout.server import protocol
from rollout.server.bodies import read_json
from rollout.server.run import run_all
from rollout.server.state import state_of

_FINISH = {"stop": "stop", "length": "length", "abort": "abort"}
# OpenAI names -> SGLang sampling_params names; SGLang extensions pass through under their own names.
_RENAMES = {"max_tokens": "max_new_tokens", "max_completion_tokens": "max_new_tokens", "seed": "sampling_seed",
            "min_tokens": "min_new_tokens"}
_PASSTHROUGH = {"temperature", "top_p", "top_k", "min_p", "stop", "stop_token_ids", "ignore_eos", "skip_special_tokens",
                "no_stop_trim", "n", "frequency_penalty", "presence_penalty", "repetition_penalty", "logit_bias",
                "spaces_between_special_tokens"}
_IGNORED = {"model", "user", "stream_options", "service_tier", "metadata", "store", "parallel_tool_calls"}
_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)
_ARG = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)


def _sampling_from_openai(body: dict, default_max_tokens: int | None, extra_known: set[str]) -> dict:
    """OpenAI request fields -> an SGLang sampling_params dict (validated later by protocol.parse_sampling_params)."""
    params: dict[str, Any] = {}
    if default_max_tokens is not None:
        params["max_new_tokens"] = default_max_tokens
    for key, value in body.items():
        if key in _RENAMES:
            if value is not None:
                params[_RENAMES[key]] = value
        elif key in _PASSTHROUGH:
            if value is not None:
                params[key] = value
        elif key not in _IGNORED and key not in extra_known:
            raise RequestError(f"{key} is not a supported request field")
    if body.get("stream"):
        raise RequestError("stream=true is not supported on the /v1 routes of the embedded server; use POST /generate with stream")
    return params


def _parse_sampling(sampling: dict, body: dict) -> tuple[Any, int]:
    """protocol.parse_sampling_params of `sampling`, its errors naming the field as `body` spells it (max_tokens, seed,
    temperature), not as SGLang's sampling_params does."""
    try:
        return protocol.parse_sampling_params(sampling)
    except RequestError as e:
        message = str(e)
        for name, sglang_name in _RENAMES.items():
            if name in body:
                message = message.replace(f"sampling_params.{sglang_name}", name)
        raise RequestError(message.replace("sampling_params.", "")) from None


def _usage(prompts: list[list[int]], outs: list) -> dict:
    """Prompt tokens count once per prompt (not per sample), completion tokens over every sample."""
    prompt_tokens = sum(len(p) for p in prompts)
    completion = sum(len(o.output_ids) for o in outs)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion}


def _finish(reason: dict | None, has_tool_calls: bool = False) -> str:
    kind = (reason or {}).get("type", "abort")
    if has_tool_calls and kind == "stop":
        return "tool_calls"
    return _FINISH.get(kind, kind)


def _prompts_from(prompt: Any, st) -> list[list[int]]:
    """OpenAI `prompt`: a string, a list of strings, a list of token ids, or a list of such lists."""
    if isinstance(prompt, str):
        raw, names = [prompt], ["prompt"]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        raw, names = prompt, [f"prompt[{i}]" for i in range(len(prompt))]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, int) and not isinstance(p, bool) for p in prompt):
        raw, names = [prompt], ["prompt"]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, list) for p in prompt):
        raw, names = prompt, [f"prompt[{i}]" for i in range(len(prompt))]
    else:
        raise RequestError("prompt must be a string, a list of strings, a list of token ids, or a list of token-id lists")
    prompts = []
    for p, name in zip(raw, names):
        if isinstance(p, str):
            if st.tokenizer is None:
                raise RequestError(f"{name}: this server has no tokenizer; send token ids")
            protocol.check_text_size(p, name, st.max_prompt_tokens)
            p = list(st.tokenizer.encode(p))
        prompts.append(protocol.check_input_ids(p, name, vocab_size=st.vocab_size, max_prompt_tokens=st.max_prompt_tokens))
    return prompts


def _expand(prompts: list[list[int]], params, n: int, **flags) -> list[GenerateRequest]:
    if len(prompts) * n > protocol.MAX_EXPANDED_REQUESTS:
        raise RequestError(f"the request expands to {len(prompts) * n} generations; the limit is {protocol.MAX_EXPANDED_REQUESTS}")
    base = uuid.uuid4().hex
    return [
        GenerateRequest(input_ids=list(p), sampling=protocol.nth_sample(params, j) if n > 1 else params,
                        rid=f"{base}_{i}_{j}", stream=False, **flags)
        for i, p in enumerate(prompts) for j in range(n)
    ]


async def completions(request: web.Request) -> web.Response:
    st = state_of(request)
    st.check_ready()
    body = await read_json(request, st.max_body_bytes)
    if not isinstance(body, dict):
        raise RequestError(f"the request body must be a JSON object, got {type(body).__name__}")
    if "prompt" not in body:
        raise RequestError("prompt is required")
    if body.get("echo"):
        raise RequestError("echo=true is not supported by the embedded server")
    if body.get("best_of") not in (None, 1) or body.get("suffix") is not None:
        raise RequestError("best_of and suffix are not supported by the embedded server")
    logprobs = body.get("logprobs")
    if logprobs is not None and (not isinstance(logprobs, int) or isinstance(logprobs, bool) or logprobs not in (0, 1)):
        raise RequestError(f"logprobs must be null, 0 or 1 (top alternatives are not computed), got {logprobs!r}")
    sampling = _sampling_from_openai(body, 16, {"prompt", "echo", "best_of", "suffix", "logprobs", "stream"})
    params, n = _parse_sampling(sampling, body)
    prompts = await asyncio.to_thread(_prompts_from, body["prompt"], st)  # tokenising: off the event loop
    reqs = _expand(prompts, params, n, return_logprob=logprobs is not None)
    outs = await run_all(st.engine, reqs)
    choices = []
    for i, (req, out) in enumerate(zip(reqs, outs)):
        choice = {"index": i, "text": protocol.response_text(st.tokenizer, out, req.sampling), "logprobs": None,
                  "finish_reason": _finish(out.finish_reason), "matched_stop": (out.finish_reason or {}).get("matched")}
        if logprobs is not None:
            tokens = [protocol.decode_text(st.tokenizer, [t], False) for t in out.output_ids]
            offsets, pos = [], 0
            for tok in tokens:
                offsets.append(pos)
                pos += len(tok)
            choice["logprobs"] = {"tokens": tokens, "token_logprobs": [float(x) for x in out.output_token_logprobs],
                                  "top_logprobs": None, "text_offset": offsets}
        choices.append(choice)
    return web.json_response({
        "id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
        "model": st.served_model_name, "choices": choices, "usage": _usage(prompts, outs),
    })


def _check_messages(messages: Any) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty list of {role, content} objects")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise RequestError(f"messages[{i}] must be an object with a string role")
        content = m.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise RequestError(f"messages[{i}].content must be a string, a list of parts, or null")
        for j, part in enumerate(content if isinstance(content, list) else ()):
            _check_part(part, f"messages[{i}].content[{j}]")
        for call in m.get("tool_calls") or []:
            fn = call.get("function", call) if isinstance(call, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise RequestError(f"messages[{i}].tool_calls entries need function.name")
            if isinstance(fn.get("arguments"), str):  # OpenAI sends a JSON string; the template wants the object
                try:
                    fn["arguments"] = json.loads(fn["arguments"])
                except json.JSONDecodeError:
                    raise RequestError(f"messages[{i}].tool_calls: function.arguments is not valid JSON") from None
    return messages


def _check_part(part: Any, where: str) -> None:
    """A content part must be {"type": "text", "text": str}: the chat template renders text parts only, and would drop
    an image or audio part without a word."""
    if not isinstance(part, dict):
        raise RequestError(f"{where} must be an object {{type, text}}, got {type(part).__name__}")
    if part.get("type") != "text":
        raise RequestError(f"{where} has type {part.get('type')!r}; the embedded server takes text parts only")
    if not isinstance(part.get("text"), str):
        raise RequestError(f"{where}.text must be a string, got {part.get('text')!r}")


def _chat_prompt(body: dict, st) -> list[int]:
    if body.get("input_ids") is not None:
        return protocol.check_input_ids(body["input_ids"], "input_ids", vocab_size=st.vocab_size,
                                        max_prompt_tokens=st.max_prompt_tokens)
    messages = _check_messages(body.get("messages"))
    protocol.check_text_size(json.dumps(messages, ensure_ascii=False), "messages", st.max_prompt_tokens)
    if st.tokenizer is None or not getattr(st.tokenizer, "chat_template", None):
        raise RequestError("this server has no tokenizer with a chat template; send input_ids")
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise RequestError("tools must be a list of tool definitions")
    if body.get("tool_choice") == "none":
        tools = None
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise RequestError("chat_template_kwargs must be an object")
    try:
        text = st.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False, **kwargs)
    except Exception as e:  # jinja's raise_exception and template errors describe the bad message
        raise RequestError(f"messages could not be rendered by the chat template: {e}") from None
    ids = list(st.tokenizer.encode(text, add_special_tokens=False))
    return protocol.check_input_ids(ids, "messages", vocab_size=st.vocab_size, max_prompt_tokens=st.max_prompt_tokens)


def split_reasoning(text: str) -> tuple[str | None, str]:
    """glm45 reasoning parser: (reasoning_content, content)."""
    if "</think>" in text:
        reasoning, content = text.split("</think>", 1)
        return reasoning.replace("<think>", "", 1).strip(), content.strip()
    if text.lstrip().startswith("<think>"):  # cut off while thinking
        return text.lstrip()[len("<think>"):].strip(), ""
    return None, text


def parse_tool_calls(text: str) -> tuple[str, list[dict]]:
    """glm47 tool-call parser: (content without the calls, [OpenAI tool_call objects])."""
    calls = []
    for body in _TOOL_CALL.findall(text):
        body = body.strip()
        name, arguments = None, None
        try:
            obj = json.loads(body)
            if isinstance(obj, dict) and isinstance(obj.get("name"), str):
                name, arguments = obj["name"], obj.get("arguments", obj.get("parameters", {}))
        except json.JSONDecodeError:
            head = body.split("<arg_key>", 1)[0].strip()
            if head:
                name, arguments = head, {}
                for key, value in _ARG.findall(body):
                    try:
                        arguments[key.strip()] = json.loads(value)
                    except json.JSONDecodeError:
                        arguments[key.strip()] = value
        if name is None:
            continue  # not a parsable call: leave it in the content
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments, ensure_ascii=False)
        calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                      "function": {"name": name, "arguments": arguments}})
    content = _TOOL_CALL.sub("", text).strip() if calls else text
    return content, calls


async def chat_completions(request: web.Request) -> web.Response:
    st = state_of(request)
    st.check_ready()
    body = await read_json(request, st.max_body_bytes)
    if not isinstance(body, dict):
        raise RequestError(f"the request body must be a JSON object, got {type(body).__name__}")
    want_logprobs = body.get("logprobs") or False
    if not isinstance(want_logprobs, bool):
        raise RequestError(f"logprobs must be a boolean, got {want_logprobs!r}")
    if body.get("top_logprobs") not in (None, 0):
        raise RequestError("top_logprobs > 0 is not supported by the embedded server (alternatives are not computed)")
    extra = {"messages", "tools", "tool_choice", "input_ids", "chat_template_kwargs", "logprobs", "top_logprobs",
             "separate_reasoning", "stream", "response_format"}
    if body.get("response_format") not in (None, {"type": "text"}):
        raise RequestError("response_format other than text is not supported by the embedded server")
    sampling = _sampling_from_openai(body, None, extra)
    params, n = _parse_sampling(sampling, body)
    prompt = await asyncio.to_thread(_chat_prompt, body, st)  # templating and tokenising: off the event loop
    parse_tools = bool(body.get("tools")) and body.get("tool_choice") != "none"
    separate = body.get("separate_reasoning", True) is not False
    reqs = _expand([prompt], params, n, return_logprob=want_logprobs)
    outs = await run_all(st.engine, reqs)
    choices = []
    for i, (req, out) in enumerate(zip(reqs, outs)):
        text = protocol.response_text(st.tokenizer, out, req.sampling)
        reasoning, content = split_reasoning(text) if separate else (None, text)
        calls = []
        if parse_tools:
            content, calls = parse_tool_calls(content)
        message = {"role": "assistant", "content": content if (content or not calls) else None,
                   "reasoning_content": reasoning, "tool_calls": calls or None}
        choice = {"index": i, "message": message, "logprobs": None, "finish_reason": _finish(out.finish_reason, bool(calls)),
                  "matched_stop": (out.finish_reason or {}).get("matched")}
        if want_logprobs:
            choice["logprobs"] = {"content": [
                {"token": protocol.decode_text(st.tokenizer, [t], False), "logprob": float(lp), "top_logprobs": [],
                 "bytes": list(protocol.decode_text(st.tokenizer, [t], False).encode())}
                for t, lp in zip(out.output_ids, out.output_token_logprobs)
            ]}
        choices.append(choice)
    completion = sum(len(o.output_ids) for o in outs)
    return web.json_response({
        "id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
        "model": st.served_model_name, "choices": choices,
        "usage": {"prompt_tokens": len(prompt), "completion_tokens": completion, "total_tokens": len(prompt) + completion},
    })


async def models(request: web.Request) -> web.Response:
    st = state_of(request)
    return web.json_response({"object": "list", "data": [
        {"id": st.served_model_name, "object": "model", "created": int(st.started_at), "owned_by": "slime-dsa",
         "root": st.model_path}]})


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
