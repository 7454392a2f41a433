"""SGLang's native /generate protocol: request JSON -> GenerateRequest list, GenerateOutput -> response JSON.

Field names, defaults and response shapes follow shared/SGLANG_PROTOCOL.md. Every check raises RequestError
naming the field; the app turns it into HTTP 400 {"error": {"message": ...}}.
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import math
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import orjson
import pybase64

from rollout.engine.stop import decode_ids
from rollout.engine.types import GenerateOutput, GenerateRequest, RequestError, SamplingParams

logger = logging.getLogger(__name__)

# sampling_params keys our SamplingParams holds, with the JSON types each accepts.
_SAMPLING_FIELDS: dict[str, tuple[type, ...]] = {
    "max_new_tokens": (int,), "temperature": (int, float), "top_p": (int, float), "top_k": (int,),
    "min_p": (int, float), "min_new_tokens": (int,), "ignore_eos": (bool,), "skip_special_tokens": (bool,),
    "no_stop_trim": (bool,), "sampling_seed": (int, type(None)),
}
# SGLang sampling_params we accept only at the value that leaves the request's meaning unchanged.
_SAMPLING_NEUTRAL: dict[str, Any] = {
    "frequency_penalty": 0, "presence_penalty": 0, "repetition_penalty": 1, "json_schema": None, "regex": None,
    "ebnf": None, "structural_tag": None, "logit_bias": None, "custom_params": None, "stream_interval": None,
    "lora_path": None,
}
# Keys that only shape detokenized text; accepted (text decoding uses skip_special_tokens only).
_SAMPLING_TEXT_ONLY = {"spaces_between_special_tokens"}

# Top-level /generate fields SGLang defines that we do not implement, with their neutral value.
_GENERATE_NEUTRAL: dict[str, Any] = {
    "token_ids_logprob": None, "return_hidden_states": False, "return_routed_experts": False,
    "lora_path": None, "lora_id": None, "image_data": None, "video_data": None, "audio_data": None,
    "input_embeds": None, "custom_logit_processor": None,
}
_GENERATE_KNOWN = {
    "text", "input_ids", "sampling_params", "rid", "return_logprob", "logprob_start_len", "return_text_in_logprobs",
    "stream", "session_id", "session_params", "return_indexer_topk", "indexer_topk_start_len", "top_logprobs_num",
    "input_logprob_temperature", *_GENERATE_NEUTRAL,
}

MAX_EXPANDED_REQUESTS = 4096  # prompts x n in one HTTP request: bounds the memory one request can claim
# A text prompt longer than this many characters per allowed token is refused before it is tokenised: tokenising
# 15 MiB once took 71 s and 6.7 GB. Real text runs 3-5 characters a token; 32 leaves room for long whitespace runs.
MAX_TEXT_CHARS_PER_TOKEN = 32


class PromptTooLargeError(RequestError):
    """A prompt over the server's limits, found before any tokenising (HTTP 413)."""

    status = 413


def check_text_size(text: str, where: str, max_prompt_tokens: int | None) -> None:
    """PromptTooLargeError naming `where` when `text` cannot fit max_prompt_tokens; call it before tokenising."""
    if max_prompt_tokens is not None and len(text) > max_prompt_tokens * MAX_TEXT_CHARS_PER_TOKEN:
        raise PromptTooLargeError(
            f"{where} has {len(text)} characters; the limit is {max_prompt_tokens * MAX_TEXT_CHARS_PER_TOKEN} "
            f"({MAX_TEXT_CHARS_PER_TOKEN} per token of max_prompt_tokens {max_prompt_tokens}), refused before tokenising")


@dataclass
class GenerateCall:
    """A parsed /generate request: one GenerateRequest per (prompt, sample), in response order."""

    requests: list[GenerateRequest]
    is_batch: bool  # the response is a JSON list
    stream: bool = False
    return_text_in_logprobs: bool = False


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _type_ok(value: Any, types: tuple[type, ...]) -> bool:
    if isinstance(value, bool):
        return bool in types
    return isinstance(value, types)


def _type_names(types: tuple[type, ...]) -> str:
    names = {int: "integer", float: "number", bool: "boolean", str: "string", type(None): "null"}
    return " or ".join(names.get(t, t.__name__) for t in types)


def parse_sampling_params(raw: Any, where: str = "sampling_params", vocab_size: int | None = None) -> tuple[SamplingParams, int]:
    """One SGLang sampling_params dict -> (SamplingParams, n). Raises RequestError naming the field."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise RequestError(f"{where} must be an object, got {type(raw).__name__}")
    kwargs: dict[str, Any] = {}
    n = 1
    for key, value in raw.items():
        name = f"{where}.{key}"
        if key in _SAMPLING_FIELDS:
            if not _type_ok(value, _SAMPLING_FIELDS[key]):
                raise RequestError(f"{name} must be {_type_names(_SAMPLING_FIELDS[key])}, got {value!r}")
            kwargs[key] = float(value) if float in _SAMPLING_FIELDS[key] and _is_int(value) else value
        elif key == "stop":
            if value is None:
                continue
            stops = [value] if isinstance(value, str) else value
            if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
                raise RequestError(f"{name} must be a string or a list of non-empty strings, got {value!r}")
            kwargs["stop"] = stops
        elif key == "stop_token_ids":
            if value is None:
                continue
            if not isinstance(value, list) or not all(_is_int(t) for t in value):
                raise RequestError(f"{name} must be a list of integer token ids, got {value!r}")
            kwargs["stop_token_ids"] = value
        elif key == "n":
            if not _is_int(value) or value < 1:
                raise RequestError(f"{name} must be a positive integer, got {value!r}")
            n = value
        elif key in _SAMPLING_NEUTRAL:
            if value is not None and value != _SAMPLING_NEUTRAL[key]:
                raise RequestError(f"{name}={value!r} is not supported by the embedded engine (only {_SAMPLING_NEUTRAL[key]!r})")
        elif key in _SAMPLING_TEXT_ONLY:
            if not isinstance(value, bool):
                raise RequestError(f"{name} must be a boolean, got {value!r}")
        else:
            raise RequestError(f"{name} is not a known sampling parameter")
    if kwargs.get("temperature") is not None and not math.isfinite(kwargs["temperature"]):
        raise RequestError(f"{where}.temperature must be finite, got {kwargs['temperature']!r}")
    params = SamplingParams(**kwargs)
    try:
        params.validate(vocab_size)
    except RequestError as e:  # validate() names "sampling_params.X"; name the batch entry when there is one
        if where != "sampling_params":
            raise RequestError(str(e).replace("sampling_params", where, 1)) from None
        raise
    seed = params.sampling_seed
    if n > 1 and seed is not None and seed + n - 1 >= 2**64:
        raise RequestError(f"{where}.sampling_seed {seed} with n={n}: sample j gets seed sampling_seed + j, which "
                           "must stay below 2**64 (a torch generator seed)")
    return params, n


def _tokenize(text: Any, where: str, tokenizer: Any, max_prompt_tokens: int | None) -> list[int]:
    if not isinstance(text, str):
        raise RequestError(f"{where} must be a string, got {type(text).__name__}")
    if tokenizer is None:
        raise RequestError(f"{where}: this server has no tokenizer; send input_ids instead of text")
    check_text_size(text, where, max_prompt_tokens)
    return list(tokenizer.encode(text))


def has_text(body: Any) -> bool:
    """Whether a /generate body asks for tokenising (run parse_generate off the event loop then)."""
    return isinstance(body, dict) and body.get("text") is not None


def all_ints(values: Any) -> bool:
    """Whether every item is an int (a bool is not): one pass in C, for the prompts of every request."""
    return set(map(type, values)) <= {int}


def check_input_ids(ids: Any, where: str, *, vocab_size: int | None, max_prompt_tokens: int | None) -> list[int]:
    """A prompt of token ids: non-empty list of ints in [0, vocab_size), at most max_prompt_tokens long."""
    if not isinstance(ids, list) or not all_ints(ids):
        raise RequestError(f"{where} must be a list of integer token ids")
    if not ids:
        raise RequestError(f"{where} is empty; a prompt needs at least one token")
    if max_prompt_tokens is not None and len(ids) > max_prompt_tokens:
        raise RequestError(f"{where} has {len(ids)} tokens; the limit is {max_prompt_tokens} (max_prompt_tokens)")
    if min(ids) < 0 or (vocab_size is not None and max(ids) >= vocab_size):
        bad = next(t for t in ids if t < 0 or (vocab_size is not None and t >= vocab_size))
        raise RequestError(f"{where} holds {bad}, not a token id in [0, {vocab_size})")
    return ids


def _per_item(value: Any, name: str, count: int, is_batch: bool) -> list[Any]:
    """SGLang lets a batch field be one value for all prompts or a list with one per prompt."""
    if is_batch and isinstance(value, list):
        if len(value) != count:
            raise RequestError(f"{name} has {len(value)} entries but the batch has {count} prompts")
        return value
    return [value] * count


def parse_generate(
    body: Any, *, tokenizer: Any = None, vocab_size: int | None = None, max_prompt_tokens: int | None = None
) -> GenerateCall:
    """Validate a /generate body and expand it (batch x n) into GenerateRequests, prompt-major like SGLang."""
    if not isinstance(body, dict):
        raise RequestError(f"the request body must be a JSON object, got {type(body).__name__}")
    for key, neutral in _GENERATE_NEUTRAL.items():
        if body.get(key) is not None and body[key] != neutral:
            raise RequestError(f"{key}={body[key]!r} is not supported by the embedded engine")
    unknown = sorted(set(body) - _GENERATE_KNOWN)
    if unknown:
        logger.info("/generate: ignoring fields %s", unknown)
    has_text, has_ids = body.get("text") is not None, body.get("input_ids") is not None
    if has_text == has_ids:
        raise RequestError("exactly one of text and input_ids must be given" + (", not both" if has_text else ""))

    if has_text:
        text = body["text"]
        is_batch = isinstance(text, list)
        if is_batch and not text:
            raise RequestError("text is an empty list")
        texts = text if is_batch else [text]
        names = [f"text[{i}]" if is_batch else "text" for i in range(len(texts))]
        for t, name in zip(texts, names):  # every size first: nothing is tokenised for a request that is refused
            if isinstance(t, str):
                check_text_size(t, name, max_prompt_tokens)
        prompts = [_tokenize(t, name, tokenizer, max_prompt_tokens) for t, name in zip(texts, names)]
        prompts = [
            check_input_ids(p, f"text[{i}]" if is_batch else "text", vocab_size=vocab_size, max_prompt_tokens=max_prompt_tokens)
            for i, p in enumerate(prompts)
        ]
    else:
        ids = body["input_ids"]
        if not isinstance(ids, list) or not ids:
            raise RequestError("input_ids must be a non-empty list of token ids (or a list of such lists for a batch)")
        is_batch = isinstance(ids[0], list)
        raw = ids if is_batch else [ids]
        prompts = [
            check_input_ids(p, f"input_ids[{i}]" if is_batch else "input_ids", vocab_size=vocab_size, max_prompt_tokens=max_prompt_tokens)
            for i, p in enumerate(raw)
        ]
    count = len(prompts)

    raw_params = body.get("sampling_params")
    if isinstance(raw_params, list) and not is_batch:
        raise RequestError("sampling_params is a list but the request has a single prompt")
    params_list = _per_item(raw_params, "sampling_params", count, is_batch)
    parsed = [
        parse_sampling_params(p, f"sampling_params[{i}]" if isinstance(raw_params, list) else "sampling_params", vocab_size)
        for i, p in enumerate(params_list)
    ]
    ns = {n for _, n in parsed}
    if len(ns) > 1:
        raise RequestError(f"sampling_params.n must be the same for every prompt of a batch, got {sorted(ns)}")
    n = ns.pop()

    flags = {}
    for key in ("return_logprob", "return_text_in_logprobs", "stream", "return_indexer_topk"):
        value = body.get(key, False)
        if value is None:
            value = False
        if not isinstance(value, bool):
            raise RequestError(f"{key} must be a boolean, got {value!r}")
        flags[key] = value

    scoring = _scoring_fields(body, prompts, parsed, is_batch, flags["return_logprob"])

    topk_start_len = body.get("indexer_topk_start_len", -1)
    if topk_start_len is None:
        topk_start_len = -1
    if not _is_int(topk_start_len) or topk_start_len < -1:
        raise RequestError(f"indexer_topk_start_len must be an integer >= -1, got {topk_start_len!r}")

    rids = _per_item(body.get("rid"), "rid", count, is_batch)
    for i, rid in enumerate(rids):
        if rid is not None and (not isinstance(rid, str) or not rid):
            raise RequestError(f"rid{f'[{i}]' if is_batch else ''} must be a non-empty string, got {rid!r}")

    session_id = body.get("session_id")
    session_params = body.get("session_params")
    if session_id is None and isinstance(session_params, dict):
        session_id = session_params.get("id")
    if session_id is not None and not isinstance(session_id, str):
        raise RequestError(f"session_id must be a string, got {session_id!r}")

    if count * n > MAX_EXPANDED_REQUESTS:
        raise RequestError(f"the request expands to {count} prompts x n={n} = {count * n} generations; "
                           f"the limit is {MAX_EXPANDED_REQUESTS}")
    requests = []
    for i, (prompt, (params, _)) in enumerate(zip(prompts, parsed)):
        base = rids[i] or uuid.uuid4().hex
        for j in range(n):
            requests.append(
                GenerateRequest(
                    input_ids=list(prompt),
                    sampling=params if n == 1 else nth_sample(params, j),
                    rid=base if n == 1 else f"{base}_{j}",
                    return_logprob=flags["return_logprob"],
                    return_indexer_topk=flags["return_indexer_topk"],
                    indexer_topk_start_len=topk_start_len,
                    session_id=session_id,
                    stream=flags["stream"],
                    **scoring[i],
                )
            )
    return GenerateCall(
        requests=requests,
        is_batch=is_batch or n > 1,
        stream=flags["stream"],
        return_text_in_logprobs=flags["return_text_in_logprobs"],
    )


def _scoring_fields(body: dict, prompts: list[list[int]], parsed: list[tuple[SamplingParams, int]], is_batch: bool,
                    return_logprob: bool) -> list[dict[str, Any]]:
    """Per prompt: logprob_start_len, top_logprobs_num and input_logprob_temperature (each one value or a list with
    one per prompt, as SGLang takes them). Input log-probs come from prefill-only requests (max_new_tokens 0)."""
    count = len(prompts)
    starts = _per_item(-1 if body.get("logprob_start_len") is None else body["logprob_start_len"],
                       "logprob_start_len", count, is_batch)
    tops = _per_item(body.get("top_logprobs_num") or 0, "top_logprobs_num", count, is_batch)
    temps = _per_item(1.0 if body.get("input_logprob_temperature") is None else body["input_logprob_temperature"],
                      "input_logprob_temperature", count, is_batch)
    out = []
    for i, (prompt, (params, _), start, top, temp) in enumerate(zip(prompts, parsed, starts, tops, temps)):
        at = f"[{i}]" if is_batch else ""
        if not _is_int(start) or start < -1:
            raise RequestError(f"logprob_start_len{at} must be an integer >= -1, got {start!r}")
        if not _is_int(top) or top < 0:
            raise RequestError(f"top_logprobs_num{at} must be a non-negative integer, got {top!r}")
        if isinstance(temp, bool) or not isinstance(temp, (int, float)) or not math.isfinite(temp) or temp <= 0:
            raise RequestError(f"input_logprob_temperature{at} must be a finite number > 0, got {temp!r}")
        prefill_only = params.max_new_tokens == 0
        if return_logprob and start != -1 and start < len(prompt) and not prefill_only:
            raise RequestError(
                f"logprob_start_len{at}={start} asks for prompt log-probs, which the embedded engine computes only "
                "for prefill-only requests (sampling_params.max_new_tokens 0); use -1 (output tokens only)")
        if top and not (return_logprob and prefill_only and start >= 0):
            raise RequestError(f"top_logprobs_num{at}={top} is supported by the embedded engine only for input "
                               "log-probs of a prefill-only request (return_logprob, logprob_start_len >= 0, "
                               "sampling_params.max_new_tokens 0)")
        out.append({"logprob_start_len": start, "top_logprobs_num": top, "input_logprob_temperature": float(temp)})
    return out


def nth_sample(params: SamplingParams, j: int) -> SamplingParams:
    """The j-th of n parallel samples: a copy whose sampling_seed (if any) is offset by j, so samples differ (SGLang
    gives all n one seed). The RL client relies on it: a group's n samples with consecutive seeds in one call."""
    copy = SamplingParams(**{**vars(params), "stop": list(params.stop), "stop_token_ids": list(params.stop_token_ids)})
    if copy.sampling_seed is not None:
        copy.sampling_seed += j
    return copy


def encode_int32(array: Any) -> tuple[str, list[int]]:
    """(base64 of the little-endian int32 bytes, shape), the way SGLang encodes routed_experts / indexer_topk."""
    import numpy as np

    if hasattr(array, "detach"):  # a torch tensor
        array = array.detach().cpu().numpy()
    arr = np.ascontiguousarray(np.asarray(array), dtype="<i4")
    # pybase64 (SIMD) reads the array's buffer in place: no bytes copy of a replay array (hundreds of KiB a request).
    return pybase64.b64encode(arr.reshape(-1).view(np.uint8)).decode("ascii"), list(arr.shape)


def response_json(body: Any, outputs: list[GenerateOutput]) -> bytes:
    """A /generate response body as JSON bytes, by orjson as SGLang's server writes it. orjson is ~20x the standard
    library on log-prob lists (0.02 against 0.39 ms for 16 samples of 20 tokens), and the event loop that runs this
    shares the GIL with the engine's step thread. orjson writes a non-finite float as null, which a client would
    refuse as a log-prob; a body whose outputs hold one keeps the standard library's NaN / Infinity as before."""
    if all(_finite(out.output_token_logprobs) and _finite(out.input_token_logprobs or ()) for out in outputs):
        return orjson.dumps(body)
    return json.dumps(body).encode()


def _finite(values: Any) -> bool:
    """No NaN or infinity among these floats (None entries, as input log-probs start with, allowed)."""
    try:
        return all(map(math.isfinite, values))
    except TypeError:  # a None
        return all(v is None or math.isfinite(v) for v in values)


def token_logprobs(logprobs: list[float], ids: list[int]) -> list[list]:
    """[[log-prob, token id, None], ...]: SGLang's output_token_logprobs without texts. The engine's log-probs are
    Python floats and its ids Python ints already (tolist), so nothing is converted per token."""
    return [[lp, tok, None] for lp, tok in zip(logprobs, ids)]


def decode_text(tokenizer: Any, ids: list[int], skip_special_tokens: bool) -> str:
    """The text of `ids` ("" without a tokenizer)."""
    if tokenizer is None or not ids:
        return ""
    return decode_ids(tokenizer, ids, skip_special_tokens)


def response_text(tokenizer: Any, out: GenerateOutput, params: SamplingParams) -> str:
    """Detokenized output, trimmed at the matched stop (SGLang's default unless no_stop_trim)."""
    ids = out.output_ids
    reason = out.finish_reason or {}
    matched = reason.get("matched") if reason.get("type") == "stop" else None
    trim = not params.no_stop_trim
    if trim and isinstance(matched, int) and not isinstance(matched, bool) and ids and ids[-1] == matched:
        ids = ids[:-1]
    text = decode_text(tokenizer, ids, params.skip_special_tokens)
    if trim and isinstance(matched, str):
        cut = text.find(matched)
        if cut >= 0:
            text = text[:cut]
    return text


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off while a call's responses are built: they are acyclic lists (one per
    output token with log-probs) that the collector would otherwise scan again and again as they pile up."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def build_response(
    out: GenerateOutput,
    req: GenerateRequest,
    *,
    tokenizer: Any,
    e2e_latency: float,
    return_text_in_logprobs: bool = False,
) -> dict:
    """SGLang's /generate response object for one request (cumulative: also used for stream chunks)."""
    meta: dict[str, Any] = {
        "id": out.rid,
        "finish_reason": out.finish_reason,
        "prompt_tokens": out.prompt_tokens,
        "completion_tokens": len(out.output_ids),
        "cached_tokens": out.cached_tokens,
        "weight_version": out.weight_version,
        "e2e_latency": e2e_latency,
        "output_token_versions": list(out.output_token_versions),
    }
    if req.return_logprob:
        if return_text_in_logprobs:
            texts = [decode_text(tokenizer, [t], False) or None for t in out.output_ids]
            meta["output_token_logprobs"] = [
                [float(lp), int(tok), txt] for lp, tok, txt in zip(out.output_token_logprobs, out.output_ids, texts)
            ]
        else:  # the common case, one entry per output token: no texts to zip in
            meta["output_token_logprobs"] = token_logprobs(out.output_token_logprobs, out.output_ids)
        meta["input_token_logprobs"] = []
        if out.input_token_logprobs is not None:  # prefill-only scoring, aligned with input_ids[logprob_start_len:]
            ids = req.input_ids[req.logprob_start_len:]
            meta["input_token_logprobs"] = [[lp, tok, None] for lp, tok in zip(out.input_token_logprobs, ids)]
            meta["input_logprob_temperature"] = req.input_logprob_temperature
            if out.input_top_logprobs is not None:
                meta["input_top_logprobs"] = [None if row is None else [[lp, tok, None] for lp, tok in row]
                                              for row in out.input_top_logprobs]
    if req.return_indexer_topk and out.indexer_topk is not None:
        meta["indexer_topk"], meta["indexer_topk_shape"] = encode_int32(out.indexer_topk)
        meta["indexer_topk_start"] = out.indexer_topk_start
    return {
        "text": response_text(tokenizer, out, req.sampling),
        "output_ids": list(out.output_ids),
        "meta_info": meta,
    }
