"""The embedded continuous-batching engine: a scheduler over a paged MLA KV cache, stepped from one thread.

One `step()` is one scheduler iteration:
1. every running request that is decoding contributes its one new token; requests still prefilling (a long
   prompt, or one re-prefilled after a retract) contribute a chunk under the `max_prefill_tokens` budget;
2. queued requests are admitted in arrival order while the cache budget, `max_running_requests` and the
   prefill budget allow; each admitted request first takes the longest cached prefix it can (prefix reuse,
   see blocks.py) and then joins this very step with the rest of its prompt;
3. ONE packed forward runs over all of it (`forward_packed` with the cache bound to this step's slots); a
   step where every request decodes one token goes through decode.py instead (no key gather; a CUDA graph
   replay on GPU);
4. the requests whose last input row was in the batch sample one token each, in one batched call, with their
   sampling parameters, seeds and stop tokens held on the device (rows.py: rebuilt only when the rows change);
5. lengths and stop tokens are checked on the device, stop strings on the host for the requests whose new token
   may complete one (the device flags those rows); finished requests leave and free their blocks.
Prefill-only scoring requests (max_new_tokens 0 with input log-probs: a teacher scoring a student's sample) take no
cache: each step first scores a batch of them in one forward of their own (scoring.py), under the prefill budget.
A step's results (tokens, log-probs, finish codes, replay rows) come to the host in one copy, queued behind its work.

Overlap (SGLang's overlap schedule; `overlap=True`, which RL recipes turn on: rollout.overlap_schedule): `step()` launches
step N+1 before it reads step N's results, so the host's bookkeeping of N (appending tokens, stop strings, outputs,
freeing) runs while the device computes N+1. A token the host does not have yet is an IN_FLIGHT placeholder in its
sequence; N+1 takes it as input straight from N's sampled tokens on the device. Lengths are known without the tokens:
a request whose in-flight token is its last is not scheduled again. A request that N ends by a stop token or string
was in N+1 too: that result is dropped (its cache rows were its own blocks, freed; later writes to them are queued
after N+1's). A block holding an in-flight token is offered to the prefix cache only once the token is read. A
scheduling failure of a request with a token in flight ends it after that token is read. Everything that changes the
engine's state from outside the step (abort, pause, weight updates, flush and memory release) first reads the step in
flight (`_drain`). So step() returns the outputs of the step launched by the call before, and requests admitted
meanwhile join one step later.

Several decode steps a launch (`num_continuous_decode_steps` k, SGLang's flag of that name; RL recipes use 4): when
the running rows all decode from the decode plan, none streams, none wants per-step replay copies, no request waits,
and each is k tokens or more from its limit, one launch queues k decode graph replays, each taking the last one's
sampled tokens and positions one on, on the device; the plan's rows whose blocks end within the k steps get their
next block first. The host schedules once and books k tokens in flight per row; reading them goes step by step, so a
request a stop token or string ends at step j takes none of the later steps' tokens (its rows written meanwhile were
its own blocks, freed as above).

Prefix reuse is content-addressed (hashes of full blocks, blocks.py): the n samples of a prompt and the turns
of a session share their common prefix without needing `session_id`. Fresh requests admitted in the same step
with identical tokens go further (a fork): only the first computes the prompt; the others copy its cache rows
for what full blocks do not cover and sample their first token from its last row. Log-probs: see sampling.py (sampled
tokens under the filtered distribution they were drawn from; greedy tokens under the raw logits).

Memory: admission reserves the blocks of prompt + limit - 1 rows (the last sampled token is never fed back; the
limit is max_new_tokens capped by the context, stop.py), so a running request can always grow and nothing is
ever preempted; requests that do not fit wait in the queue. A request that would grow past its reservation, or
whose scheduling fails otherwise, is aborted alone with the error; the others go on.

Index replay (`return_indexer_topk`): for output token j the engine returns the top-k that each full
layer selected at the query row that PRODUCED it, i.e. the row of the token before it (the prompt's last
token for j = 0, output token j - 1 after that). In a teacher-forced forward over prompt + response, row p
yields log p(x_{p+1}); so the returned array fills rows P-1 .. P+R-2 of `replay_topk` (P prompt tokens,
R output tokens). Those rows alone are not enough when a prompt row's selection is fragile (near-tied index
scores that another kernel orders differently): the prompt rows' keys and values feed every later row. So with
`indexer_topk_start_len` >= 0 the array starts at that row instead (`GenerateOutput.indexer_topk_start`) and
covers the prompt rows too. Rows below index_topk are left out: they select every causal key under any kernel.
The prompt rows come from the engine's own prefill, or, for a reused prefix, from the selections kept with the
cached blocks (`keep_indexer_topk`: PagedKVCache keeps every row's top-k next to its KV).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import os
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from rollout.engine.blocks import BlockManager, block_digests
from rollout.engine.decode import PagedDecoder
from rollout.engine.decode_plan import DecodePlan, steady_steps
from rollout.engine.defaults import DEFAULT_BLOCK_SIZE, DEFAULT_MAX_RUNNING_REQUESTS, INDEX_KEY_CACHE_DTYPES
from rollout.engine.kv_cache import PagedKVCache
from rollout.engine.rows import (LENGTH, RUNNING, SEED, STOP_TOKEN, TAIL_DECODE, TAIL_SKIP, CompleterTable, RowSpec,
                                 SamplingRows, row_spec, upload)
from rollout.engine.sample_graph import sample_rows
from rollout.engine.sampling import seed_to_int64
from rollout.engine.scoring import ScoringQueue
from rollout.engine.stop import StopChecker, match_stop_strings
from rollout.engine.stop_chars import StopCompleters
from rollout.engine.types import GenerateOutput, GenerateRequest, RequestError, SamplingParams
from slime_dsa.devices import foreach_copy
from slime_dsa.gc_watch import freeze_after_startup
from slime_dsa.models import GlmMoeDsaForCausalLM, PackedBatch, fused_pointwise
from slime_dsa.ops import invariant
from slime_dsa.ops.fp8_keys import FP8_DTYPE
from slime_dsa.trace_recorder import annotate

logger = logging.getLogger(__name__)

PAUSE_MODES = ("abort", "retract", "in_place")


# Identity semantics: sequences are found in lists by `is` and are dict keys themselves (hashed by identity), never
# compared by value. Not id(seq): id() raises an audit event, which a process-wide audit hook (filelock >= 4 adds one
# on Python 3.12) turns into a Python call per use.
@dataclass(eq=False, slots=True)
class _Sequence:
    """Engine-side state of one request."""

    req: GenerateRequest
    tokens: list[int]  # prompt + generated so far
    prompt_len: int
    stop: StopChecker  # owns the request's token limit
    serial: int  # unique per engine: names the sequence in SamplingRows.key
    row: RowSpec  # its sampling row: parameters, seed (sampling_seed, or drawn from the engine's generator), limits
    logprobs: list[float] = field(default_factory=list)
    # The weight version of each output token, as runs: (output index where a run starts, version).
    version_runs: list[tuple[int, int]] = field(default_factory=list)
    last_version: int | None = None  # the last run's version
    topk: list[np.ndarray] = field(default_factory=list)  # per output token (n_full, index_topk); not kept_topk
    retracted_topk: np.ndarray | None = None  # kept_topk: rows topk_first .. read when a retract freed them
    blocks: list[int] = field(default_factory=list)  # block table
    digests: list[bytes] = field(default_factory=list)  # of the full blocks known so far
    num_registered: int = 0  # leading blocks already offered to the prefix cache
    num_computed: int = 0  # rows in the cache
    reserved: int = 0  # blocks still promised by the admission reservation
    cache_epoch: int = -1  # prefix-cache generation the sequence was admitted under
    cached_tokens: int = 0
    failures: int = 0
    finish_reason: dict | None = None
    inflight: int = 0  # trailing tokens still being sampled on the device (IN_FLIGHT placeholders in `tokens`)

    @property
    def output_ids(self) -> list[int]:
        """The output tokens the host has (without those in flight)."""
        return self.tokens[self.prompt_len : len(self.tokens) - self.inflight]

    @property
    def num_output(self) -> int:
        """Output tokens so far, those in flight included (they count for limits, seeds and min_new_tokens)."""
        return len(self.tokens) - self.prompt_len

    @property
    def max_new_tokens(self) -> int:
        return self.stop.max_new_tokens

    @property
    def versions(self) -> list[int]:
        """The weight version of each output token the host has (one per log-prob)."""
        ends = [start for start, _ in self.version_runs[1:]] + [len(self.logprobs)]
        out: list[int] = []
        for (start, version), end in zip(self.version_runs, ends):
            out += [version] * (end - start)
        return out


IN_FLIGHT = -1  # a token in `_Sequence.tokens` that the device has sampled and the host does not have yet
IN_FLIGHT_INPUT = 0  # what the host puts in an input id that the device then overwrites with the sampled token


@dataclass(eq=False)
class _Launched:
    """A step queued on the device; `Engine._resolve` brings its tokens to the host."""

    scheduled: list[tuple[_Sequence, int]]
    sampled: list[_Sequence]  # the sequences that sample, in row order
    token_index: list[int]  # where each row's token goes in its sequence's tokens (its IN_FLIGHT placeholder)
    tokens: torch.Tensor | None  # (B,) int64 on the device: the next step's input ids, before the host has them
    result: torch.Tensor | None  # (3, B) float64 on the host: tokens, log-probs, finish codes (rows.py); copy in flight
    topk: torch.Tensor | None  # (B_wanted, n_full, K) int32 on the host: replay rows of the requests that want them
    wanted: list[int]  # rows of `topk`
    stream_rows: list[int]  # rows whose requests stream
    version: int  # weight version of the tokens
    decode_only: bool
    device_s: float  # on CPU: the forward (run on this thread); on CUDA: filled in from the events at resolve
    begin: Any = None  # torch.cuda.Event before the step's device work (CUDA only)
    done: Any = None  # torch.cuda.Event after its copy to the host (CUDA only)
    # The steps queued after this one over the same rows in the same launch (num_continuous_decode_steps), in order.
    followers: list["_Launched"] = field(default_factory=list)

    @property
    def last(self) -> "_Launched":
        """The launch's last step: its tokens are the next launch's inputs."""
        return self.followers[-1] if self.followers else self

    @functools.cached_property
    def row_of(self) -> dict[_Sequence, int]:
        """seq -> its row (built when a later step feeds from this one's device tokens: overlap only)."""
        return {seq: b for b, seq in enumerate(self.sampled)}


class Engine:
    """Continuous-batching generation over a GlmMoeDsaForCausalLM. Not thread-safe: drive it from one thread."""

    def __init__(
        self,
        model: GlmMoeDsaForCausalLM,
        *,
        max_cache_tokens: int,
        max_running_requests: int = DEFAULT_MAX_RUNNING_REQUESTS,
        eos_token_ids: list[int] | None = None,
        tokenizer: Any = None,
        weight_version: str = "0",
        block_size: int = DEFAULT_BLOCK_SIZE,
        max_prefill_tokens: int = 8192,
        enable_prefix_caching: bool = True,
        seed: int | None = None,
        paged_decode: bool = True,
        cuda_graphs: bool = True,
        keep_indexer_topk: bool = False,
        overlap: bool = False,
        index_key_cache_dtype: str = "auto",
        num_continuous_decode_steps: int = 1,
        enable_torch_compile: bool = False,
    ) -> None:
        """paged_decode: decode-only steps read the KV pool in place instead of gathering every sequence's keys
        (on CPU too: 15-20% faster decode with 100-token contexts, benchmarks/RESULTS.md); cuda_graphs: and
        replay them as CUDA graphs (CUDA only); keep_indexer_topk: every cached row's DSA selection is kept, so
        requests may ask for their prompt rows' (exact index replay); overlap: each step is launched before the
        previous step's tokens reach the host, and the host's bookkeeping of that step runs while the device
        computes (module docstring); index_key_cache_dtype: "auto" (the model's dtype) or "fp8_e4m3", the indexer
        keys cached in FP8 with a scale per row (kv_cache.py), as SGLang's DSA cache holds them;
        num_continuous_decode_steps: a decode-only step over the carried decode rows (no request waiting, none
        streaming, none wanting per-step replay rows, every row that many tokens from its limit) queues that many
        steps at once, each fed the last one's tokens on the device, so the host schedules and launches once for them
        (SGLang's --num-continuous-decode-steps); the same tokens (log-probs bit for bit where the batches match);
        enable_torch_compile: the model's small pointwise chains (norms, rotations, routing, activations) run through
        torch.compile in this engine's paged decode steps, fused into a few kernels each (models/fused_pointwise.py;
        SGLang's --enable-torch-compile): fewer kernels in a decode graph, compiled when first met (the warm-up's
        captures). Prefill steps run the eager ops. The model is the engine's own: its modules are flagged for good."""
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if max_cache_tokens < block_size:
            raise ValueError(f"max_cache_tokens ({max_cache_tokens}) must hold at least one block of block_size ({block_size}) tokens")
        if num_continuous_decode_steps < 1:
            raise ValueError(f"num_continuous_decode_steps must be >= 1, got {num_continuous_decode_steps}")
        if enable_torch_compile and invariant.is_enabled():
            raise ValueError("enable_torch_compile fuses the model's pointwise ops, which batch-invariant mode (true "
                             "on-policy) replaces with its own kernels: turn one of them off")
        if enable_torch_compile and not paged_decode:
            raise ValueError("enable_torch_compile fuses the paged decode steps' pointwise ops: it needs paged_decode")
        if max_running_requests < 1 or max_prefill_tokens < 1:
            raise ValueError(f"max_running_requests ({max_running_requests}) and max_prefill_tokens ({max_prefill_tokens}) must be >= 1")
        self.model = model.eval()
        self.enable_torch_compile = enable_torch_compile
        if enable_torch_compile:
            fused_pointwise.enable(model)
        self.config = model.config
        self.device = model.device
        self.tokenizer = tokenizer
        self.eos_token_ids = list(self.config.eos_token_ids if eos_token_ids is None else eos_token_ids)
        self.block_size = block_size
        self.max_running_requests = max_running_requests
        self.max_prefill_tokens = max_prefill_tokens
        num_blocks = max_cache_tokens // block_size
        self.max_cache_tokens = num_blocks * block_size
        self.blocks = BlockManager(num_blocks, block_size, enable_prefix_caching)
        self.cache = PagedKVCache(self.config, num_blocks, block_size, model.dtype, self.device, keep_topk=keep_indexer_topk,
                                  index_key_dtype=index_key_dtype(index_key_cache_dtype))
        self.stats: dict[str, float] = {}
        self.decoder = (PagedDecoder(model, self.cache, block_size, cuda_graphs, self.stats, max_running_requests,
                                     fuse_pointwise=enable_torch_compile)
                        if paged_decode else None)
        self.n_full_layers = len(self.config.full_layer_ids)
        self._weight_version = str(weight_version)
        self._version_int = _version_number(self._weight_version, 0)
        self._num_updates = 0
        self._cache_epoch = 0
        self._queue: deque[_Sequence] = deque()
        self._running: list[_Sequence] = []
        self._active: dict[str, _Sequence] = {}  # rid -> queued or running sequence
        self._scoring = ScoringQueue(model, max_prefill_tokens)  # prefill-only requests: they take no cache
        self._ready: list[GenerateOutput] = []  # finished without a forward (max_new_tokens == 0, a failure)
        self._paused: str | None = None
        self._released: set[str] = set()  # memory tags released for a colocated trainer
        self._params: dict[str, torch.Tensor] | None = None  # parameters_by_name(), built once
        self._step_registered: list[int] = []
        self._forks: dict[_Sequence, _Sequence] = {}  # seq -> the sequence of this step whose rows it copies
        self._rng = torch.Generator().manual_seed(int.from_bytes(os.urandom(8), "little") if seed is None else seed)
        self._serials = itertools.count()
        self._stop_windows: dict[tuple[str, ...], int] = {}  # stop strings -> tail length (stop.py), per tokenizer
        self._stop_completers = StopCompleters(tokenizer) if tokenizer is not None else None
        self._completer_table = CompleterTable(self.config.vocab_size, self.device)  # their masks, on the device
        self._rows: SamplingRows | None = None  # the last step's sampling rows, reused while the rows stay the same
        self._tables_epoch = 0  # bumped when a block table is replaced (admit, free); only appends keep it (decode.py)
        # The last launched step's sampling serials, its rows' output counts with its token on the device (a launch
        # over the same rows samples at those counts instead of reading every sequence again), (decode-only steps) its
        # positions, and (paged decode steps) the key of its block tables in the decoder.
        self._last_counts: tuple[tuple[int, ...], torch.Tensor, np.ndarray | None, Any] | None = None
        self.overlap = overlap
        self.num_continuous_decode_steps = num_continuous_decode_steps
        self._chain = 1  # the steps this schedule's launch may take (_planned_rows)
        self._stream = None  # CUDA: the side stream reading kept replay rows (_read_kept_topk)
        self._pending: _Launched | None = None  # overlap: the step on the device whose tokens the host has not read
        self._failed_later: list[tuple[_Sequence, Exception]] = []  # scheduling failures of sequences with a token in flight
        self._schedules = 0  # _schedule calls: the decode plan's clock
        self._plan: DecodePlan | None = None  # the running decode rows carried between steps (decode_plan.py)
        self.stats.update({"steps": 0, "paged_decode_steps": 0, "continued_decode_steps": 0, "prefill_tokens": 0,
                           "generated_tokens": 0,
                           "cached_tokens": 0, "scored_tokens": 0})
        # Where the step loop's time goes (cumulative; rollout.engine.perf turns two readings into rates): seconds in
        # steps, of them waiting on the device, the same for decode-only steps, and the running requests summed over
        # steps (batch occupancy).
        self.stats.update({"step_s": 0.0, "device_s": 0.0, "decode_steps": 0, "decode_step_s": 0.0,
                           "decode_device_s": 0.0, "running_sum": 0})
        # The host's part of the steps by phase (cumulative seconds): scheduling, launching (on CPU the forward and
        # sampling too), applying the tokens, stop strings, and ending requests (replay rows, freeing).
        self.stats.update({"schedule_s": 0.0, "launch_s": 0.0, "resolve_s": 0.0, "stop_strings_s": 0.0, "finish_s": 0.0})
        # Outside the steps: handing memory to a colocated trainer and taking it back (the CUDA graphs, which point at
        # the freed memory, are captured again: graph_captures, graph_capture_s).
        self.stats.update({"memory_release_s": 0.0, "memory_resume_s": 0.0, "weights_update_s": 0.0})
        self.stats.setdefault("graph_captures", 0)
        self.stats.setdefault("graph_capture_s", 0.0)
        _freeze_heap_once()
        logger.info(
            "engine: %d cache blocks x %d tokens (%.1f MiB), max_running_requests=%d, device=%s, dtype=%s",
            num_blocks, block_size, self.cache.nbytes / 2**20, max_running_requests, self.device, model.dtype,
        )

    # -- state ------------------------------------------------------------------------------------

    @property
    def weight_version(self) -> str:
        return self._weight_version

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_queued(self) -> int:
        return len(self._queue) + len(self._scoring)

    @property
    def paused(self) -> bool:
        return self._paused is not None

    @property
    def has_work(self) -> bool:
        """Whether `step()` would make progress now."""
        return bool(self._ready) or self._pending is not None or (
            self._paused is None and not self._released and bool(self._running or self._queue or self._scoring))

    # -- requests ---------------------------------------------------------------------------------

    def add_request(self, req: GenerateRequest) -> None:
        """Queue a request; it joins the running batch at the next step that has room. Raises RequestError."""
        self._add(req, None)

    def add_requests(self, reqs: list[GenerateRequest]) -> None:
        """Queue requests in order, all or none: one refused (RequestError) takes back those added before it. A
        request that differs from the one before it only in rid and sampling seed (the samples of a group) shares
        its checks, stop rules and sampling row."""
        added: list[str] = []
        last: _Sequence | None = None
        try:
            for req in reqs:
                last = self._add(req, last if last is not None and _same_but_seed(last.req, req) else None)
                added.append(req.rid)
        except BaseException:
            for rid in added:
                self.abort(rid, message="another request of its call was refused")
            raise

    def _add(self, req: GenerateRequest, like: _Sequence | None) -> _Sequence | None:
        """Queue `req`; `like`: an added sequence whose request differs from it only in rid and seed."""
        if self._released and self._paused is None:  # paused, it waits for the resume (a colocated loop's prefetch)
            raise RequestError(f"the engine's memory ({', '.join(sorted(self._released))}) is released for a colocated "
                               "trainer: POST /resume_memory_occupation first")
        if req.scores_input:
            if req.rid in self._active:
                raise RequestError(f"rid {req.rid!r} is already in use")
            self._scoring.add(req)
            return None
        seq = self._new_sequence(req) if like is None else self._sibling(like, req)
        if seq.max_new_tokens == 0:
            seq.finish_reason = {"type": "length", "length": 0}
            self._ready.append(self._output(seq))
            return seq
        self._queue.append(seq)
        self._active[req.rid] = seq
        return seq

    def _sibling(self, like: _Sequence, req: GenerateRequest) -> _Sequence:
        """A sequence for `req` from `like`'s checked prompt, stop rules and row, with its own rid and seed."""
        if req.rid in self._active:
            raise RequestError(f"rid {req.rid!r} is already in use")
        row = like.row
        seed = seed_to_int64(self._seed(req.sampling))
        ints = row.ints[:SEED] + (seed,) + row.ints[SEED + 1:]
        return _Sequence(req=req, tokens=like.tokens[:like.prompt_len], prompt_len=like.prompt_len, stop=like.stop,
                         serial=next(self._serials), row=RowSpec(row.floats, ints, row.stop_ids, row.flags))

    def _seed(self, sampling: SamplingParams) -> int:
        """The request's sampling_seed, or one drawn from the engine's generator."""
        if sampling.sampling_seed is not None:
            return sampling.sampling_seed
        return int(torch.randint(-2**63, 2**63 - 1, (), generator=self._rng))

    def _new_sequence(self, req: GenerateRequest) -> _Sequence:
        vocab = self.config.vocab_size
        ids = req.input_ids
        if not isinstance(ids, (list, tuple)) or not ids:
            raise RequestError("input_ids must be a non-empty list of token ids")
        if not set(map(type, ids)) <= {int} or min(ids) < 0 or max(ids) >= vocab:  # one C pass each (not bool)
            raise RequestError(f"input_ids must hold integer token ids in [0, {vocab})")
        req.sampling.validate(vocab)
        start_len = req.indexer_topk_start_len
        if not isinstance(start_len, int) or isinstance(start_len, bool) or start_len < -1:
            raise RequestError(f"indexer_topk_start_len must be an integer >= -1, got {start_len!r}")
        if req.return_indexer_topk and start_len >= 0 and not self.cache.keep_topk:
            raise RequestError(
                "indexer_topk_start_len >= 0 asks for the prompt rows' top-k, which this engine does not keep: start it "
                "with keep_indexer_topk (slime-dsa serve --keep-indexer-topk)"
            )
        if req.rid in self._active:
            raise RequestError(f"rid {req.rid!r} is already in use")
        context = self.config.max_position_embeddings
        if len(ids) >= context:
            raise RequestError(f"input_ids has {len(ids)} tokens, the model's context (max_position_embeddings) is {context}")
        stop = StopChecker(req.sampling, self.eos_token_ids, self.tokenizer, prompt_len=len(ids), context=context,
                           windows=self._stop_windows,
                           completing=None if self._stop_completers is None else self._stop_completers.mask)
        rows = len(ids) + stop.max_new_tokens - 1
        if -(-rows // self.block_size) > self.blocks.num_blocks:
            raise RequestError(
                f"input_ids ({len(ids)} tokens) + sampling_params.max_new_tokens ({stop.max_new_tokens}) need {rows} cache "
                f"tokens, more than the engine's max_cache_tokens ({self.max_cache_tokens})"
            )
        completer = self._completer_table.row(stop.completing) if stop.stop_strings else -1
        return _Sequence(req=req, tokens=list(ids), prompt_len=len(ids), stop=stop, serial=next(self._serials),
                         row=row_spec(req.sampling, stop, seed_to_int64(self._seed(req.sampling)), vocab,
                                      stream=req.stream, completer=completer))

    def abort(self, rid: str | None = None, abort_all: bool = False, message: str = "aborted by request") -> list[GenerateOutput]:
        """Finish the request `rid` (or all) with finish_reason abort; returns their final outputs."""
        self._drain()
        if abort_all:
            targets = list(self._running) + list(self._queue)
        else:
            targets = [self._active[rid]] if rid in self._active else []
        reason = {"type": "abort", "message": message}
        return (self._finish_all([(seq, reason) for seq in targets])
                + self._scoring.abort(rid, abort_all, reason, self._weight_version))

    def pause(self, mode: str = "abort") -> list[GenerateOutput]:
        """Stop scheduling. abort: end every request; retract: free running requests' cache and requeue them
        (re-prefilled after resume, generated tokens kept); in_place: keep everything as it is."""
        if mode not in PAUSE_MODES:
            raise RequestError(f"pause mode must be one of {PAUSE_MODES}, got {mode!r}")
        self._drain()
        outputs = []
        if mode == "abort":
            outputs = self.abort(abort_all=True, message="aborted by pause_generation")
        elif mode == "retract":
            for seq in reversed(self._running):
                self._retract(seq)
            self._running = []
            self._plan = None
        self._paused = mode
        return outputs

    def resume(self) -> None:
        self._paused = None

    # -- weights and cache ----------------------------------------------------------------------

    @torch.no_grad()
    def update_weights(self, state_dict: dict[str, torch.Tensor], weight_version: str | None = None, flush_cache: bool = True,
                       finite_spans: list[torch.Tensor] | None = None) -> None:
        """Copy tensors into the model in place (a partial dict updates only those); the prefix cache is flushed.

        All or nothing: names, shapes, dtypes (floating point, cast on copy) and finiteness are checked before
        anything is written (slime_dsa.weights.checks), so a bad dict changes nothing. weight_version, or the next
        version when none is given, is set once all are in. Requests that are running (pause in_place) continue;
        their later tokens report the new version. finite_spans: as for checks.check_update.
        """
        from slime_dsa.weights import WeightFormatError  # noqa: PLC0415
        from slime_dsa.weights.checks import check_update  # noqa: PLC0415

        start = time.perf_counter()
        self._drain()  # the tokens in flight were computed with the old weights
        params = self.parameters_by_name()
        try:
            check_update(state_dict, params, finite_spans)
        except WeightFormatError as e:
            raise RequestError(f"update_weights: {e}") from None
        # Foreach calls, not a launch per tensor from Python (they cast as copy_ does). Tied weights are one
        # destination: written once, from the last name that holds it, as a loop of copies would leave it.
        copies = {id(params[name]): (params[name], tensor) for name, tensor in state_dict.items()}
        if copies:
            foreach_copy([dst for dst, _ in copies.values()], [src for _, src in copies.values()])
        self.model.refresh_inference_caches()  # in place: captured decode graphs read these buffers
        self._num_updates += 1
        self._weight_version = str(weight_version) if weight_version is not None else _next_version(self._weight_version)
        self._version_int = _version_number(self._weight_version, self._num_updates)
        if flush_cache:
            self._reset_prefix_cache()
        self.stats["weights_update_s"] += time.perf_counter() - start  # checks, copies, derived caches (no device wait)
        logger.info("engine: updated %d tensors, weight_version=%s", len(state_dict), self._weight_version)

    def parameters_by_name(self) -> dict[str, torch.Tensor]:
        """The model's state dict of live tensors (keep_vars), built once and again after the weights move: walking
        the modules cost each update ~10 ms at 800 tensors."""
        if self._params is None:
            self._params = self.model.state_dict(keep_vars=True)
        return self._params

    def flush_cache(self) -> bool:
        """Drop the prefix cache; refused (False) while requests are running or queued, as SGLang does."""
        self._drain()
        if self._running or self._queue:
            return False
        self._reset_prefix_cache()
        return True

    MEMORY_TAGS = ("weights", "kv_cache")

    def release_memory(self, tags: list[str] | None = None) -> None:
        """Free device memory for a colocated trainer: the KV pool and/or the weights (moved to host memory).

        Only while nothing runs or waits; the prefix cache is dropped with the KV pool.
        """
        start = time.perf_counter()
        tags = self._check_memory_tags(tags)
        if "kv_cache" in tags:
            self._reset_prefix_cache()
            self.cache.release()
        if "weights" in tags:
            self.model.drop_inference_caches()
            self.model.to("cpu")
            self._params = None  # buffers are new tensors after a move
        if self.decoder is not None:
            self.decoder.reset()  # the graphs point at the memory being freed
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        self._released.update(tags)
        self.stats["memory_release_s"] += time.perf_counter() - start

    def resume_memory(self, tags: list[str] | None = None) -> None:
        """Undo release_memory: weights back on the device, a fresh KV pool."""
        start = time.perf_counter()
        tags = self._check_memory_tags(tags, releasing=False)
        if "weights" in tags:
            self.model.to(self.device)
            self._params = None
        if "kv_cache" in tags:
            self.cache.allocate()
        self._released.difference_update(tags)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the pool's zeroing is part of waking up
        self.stats["memory_resume_s"] += time.perf_counter() - start

    def _check_memory_tags(self, tags: list[str] | None, releasing: bool = True) -> list[str]:
        self._drain()
        tags = list(self.MEMORY_TAGS if tags is None else tags)
        if bad := [t for t in tags if t not in self.MEMORY_TAGS]:
            raise RequestError(f"tags may hold only {list(self.MEMORY_TAGS)}, got {bad}")
        if releasing and (self._running or self._queue or self._scoring):
            raise RequestError("memory can be released only while no request runs or waits: pause generation first")
        return tags

    def _reset_prefix_cache(self) -> None:
        self.blocks.reset_prefix_cache()
        self._cache_epoch += 1  # running sequences stop offering blocks: their rows mix weight versions

    # -- the scheduler iteration -----------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> list[GenerateOutput]:
        """One scheduler iteration; returns the outputs that changed (cumulative, finish_reason on the last).

        A request with stream=False appears only once, finished. With overlap, the step launched here is read by the
        next call: this call returns the previous step's outputs, after launching its own."""
        start = time.perf_counter()
        outputs, self._ready = self._ready, []
        if self._paused is not None or self._released:  # released memory: requests wait for the resume
            return outputs
        if self._scoring:
            outputs += self._scoring.step(self._weight_version, self.stats)
        self._step_registered = []  # blocks offered to the prefix cache by this step
        self._forks, self._failed_later = {}, []
        previous, launched = self._pending, None
        phase = time.perf_counter()
        with annotate("engine.schedule"):
            scheduled = self._schedule()
        self.stats["schedule_s"] += time.perf_counter() - phase
        outputs, self._ready = outputs + self._ready, []  # requests whose scheduling failed
        if scheduled:
            self.stats["steps"] += 1
            try:
                phase = time.perf_counter()
                with annotate("engine.launch"):
                    launched = self._launch(scheduled, previous)
                self.stats["launch_s"] += time.perf_counter() - phase
            except Exception as exc:  # noqa: BLE001 - one bad batch must not stop the engine
                logger.exception("engine: step over %d requests failed", len(scheduled))
                self._pending = None
                self._plan = None
                self._rows = None  # it may have handed out uniforms for a launch that never happened
                if previous is not None:  # the suspects' tokens in flight first
                    outputs += self._resolve(previous)
                    previous = None
                outputs += self._recover([(seq, n) for seq, n in scheduled if seq.finish_reason is None], exc)
        self._pending = None
        if previous is not None:
            with annotate("engine.resolve"):
                outputs += self._resolve(previous)  # while the device computes `launched`
        for seq, exc in self._failed_later:
            if seq.finish_reason is None:
                self._fail(seq, exc)
        if launched is not None:
            if self.overlap:
                self._pending = launched
            else:
                outputs += self._resolve(launched)
        outputs, self._ready = outputs + self._ready, []
        if scheduled or previous is not None:
            self._account_step(time.perf_counter() - start, launched)
        return outputs

    def _drain(self) -> None:
        """Read the step in flight before anything else changes the engine's state (abort, pause, weights, memory).
        Its final outputs wait in `_ready` for the next step(); intermediate streamed ones are dropped (outputs are
        cumulative: the request's next output holds them)."""
        launched, self._pending = self._pending, None
        self._plan = None  # the drained rows have no token in flight now
        if launched is None:
            return
        start = time.perf_counter()
        with torch.inference_mode():
            outputs = self._resolve(launched)
        self._ready += [out for out in outputs if out.finish_reason is not None]
        self._account_step(time.perf_counter() - start, None)

    def _resolve(self, launched: _Launched) -> list[GenerateOutput]:
        """Wait for a launch's tokens and apply them, step by step (a request that ends at one step takes none of the
        later steps' tokens)."""
        outputs = self._resolve_step(launched)
        for follower in launched.followers:
            outputs += self._resolve_step(follower)
        return outputs

    def _resolve_step(self, launched: _Launched) -> list[GenerateOutput]:
        """Wait for a launched step's tokens and apply them: append, finish, stream, offer newly full blocks.

        One pass over the rows stores the tokens; the rows that need more (finished, stop strings, streaming) are
        found from the step's finish codes and the rows' flags, not by testing every request."""
        if launched.done is not None:
            launched.done.synchronize()
            launched.device_s = launched.begin.elapsed_time(launched.done) / 1e3
            self._account_device(launched)
        if launched.result is None:
            return []
        start = time.perf_counter()
        values = launched.result.numpy()  # (3, B): tokens, log-probs, finish codes
        tokens, codes = values[0].astype(np.int64).tolist(), values[2]
        sampled, version, bs, count = launched.sampled, launched.version, self.block_size, 0
        for seq, index, token, logprob in zip(sampled, launched.token_index, tokens, values[1].tolist()):
            if seq.finish_reason is not None:
                continue  # it ended at the step before (a stop token or string): this token is not its
            seq.tokens[index] = token
            seq.inflight -= 1
            if seq.last_version != version:  # the version changes with the weights only: runs, not a list
                seq.version_runs.append((len(seq.logprobs), version))
                seq.last_version = version
            seq.logprobs.append(logprob)
            count += 1
            if index // bs > seq.num_registered:
                self._register(seq, index)  # the rows up to this token's are computed, their tokens known
        if launched.topk is not None:
            arrays = launched.topk.numpy()
            for k, b in enumerate(launched.wanted):
                if sampled[b].finish_reason is None:
                    sampled[b].topk.append(arrays[k].copy())  # a copy: no view pins the step's array
        self.stats["generated_tokens"] += count
        ending = [(sampled[b], self._finish_reason(sampled[b], tokens[b], codes[b]))
                  for b in np.flatnonzero((codes == LENGTH) | (codes == STOP_TOKEN)).tolist()
                  if sampled[b].finish_reason is None]
        # Rows with stop strings whose tail is decoded, and (streaming) those checked without a decode: the device
        # sorted them (rows.finish_codes); rows that skip the check and do not stream need nothing here.
        tail_rows = codes == TAIL_DECODE
        if launched.stream_rows:
            streams = np.zeros(len(codes), dtype=bool)
            streams[launched.stream_rows] = True
            tail_rows |= (codes == TAIL_SKIP) & streams
        strings, decode = [], []
        for b in np.flatnonzero(tail_rows).tolist():
            if sampled[b].finish_reason is None:
                strings.append(sampled[b])
                decode.append(codes[b] == TAIL_DECODE)
        outputs = [self._output(sampled[b]) for b in launched.stream_rows
                   if codes[b] == RUNNING and sampled[b].finish_reason is None]
        self.stats["resolve_s"] += time.perf_counter() - start
        start = time.perf_counter()
        outputs += self._check_stop_strings(strings, decode, ending)
        self.stats["stop_strings_s"] += time.perf_counter() - start
        start = time.perf_counter()
        outputs += self._finish_all(ending)
        self.stats["finish_s"] += time.perf_counter() - start
        return outputs

    @staticmethod
    def _finish_reason(seq: _Sequence, token: int, code: float) -> dict:
        if code == STOP_TOKEN:
            return {"type": "stop", "matched": token}
        return {"type": "length", "length": seq.max_new_tokens}

    def _check_stop_strings(self, seqs: list[_Sequence], decode: list[bool],
                            ending: list[tuple[_Sequence, dict]]) -> list[GenerateOutput]:
        """Add to `ending` the sequences whose decoded tails now hold a stop string (one batched decode of the tails
        flagged in `decode`; the others' new tokens cannot complete one: StopChecker.may_match_after); the outputs of
        those that go on (when they stream)."""
        if not seqs:
            return []
        tails = [seq for seq, flagged in zip(seqs, decode) if flagged]
        try:
            found = match_stop_strings([seq.stop for seq in tails], list(map(_tail, tails)))
        except Exception:  # noqa: BLE001 - one request's tokenizer failure must cost that request only
            found = [self._check_stop_string(seq) for seq in tails]
        outputs, found = [], iter(found)
        for seq, flagged in zip(seqs, decode):
            reason = next(found) if flagged else None
            if reason:
                ending.append((seq, reason))
            elif seq.req.stream:
                outputs.append(self._output(seq))
        return outputs

    @staticmethod
    def _check_stop_string(seq: _Sequence) -> dict | None:
        try:
            return match_stop_strings([seq.stop], [_tail(seq)])[0]
        except Exception as exc:  # noqa: BLE001 - e.g. a tokenizer error costs this request only
            logger.exception("engine: stop check of request %s failed", seq.req.rid)
            return {"type": "abort", "message": f"stop check failed: {type(exc).__name__}: {exc}"}

    def _account_step(self, seconds: float, launched: _Launched | None) -> None:
        """One call's time, counted as a decode step's when it launched one (with overlap it also read the step
        before)."""
        stats = self.stats
        stats["step_s"] += seconds
        if launched is None:
            return
        steps = 1 + len(launched.followers)
        stats["running_sum"] += len(launched.scheduled) * steps
        if launched.decode_only:
            stats["decode_steps"] += steps
            stats["decode_step_s"] += seconds

    def _account_device(self, launched: _Launched) -> None:
        """A step's device time, once known: on CPU when it is launched (the forward runs then), on CUDA when read."""
        self.stats["device_s"] += launched.device_s
        if launched.decode_only:
            self.stats["decode_device_s"] += launched.device_s

    def _schedule(self) -> list[tuple[_Sequence, int]]:
        """Pick this step's (sequence, new rows) pairs, admitting queued requests; allocates their blocks.

        Each admitted request grows (and registers its full blocks) before the next is admitted, so requests
        arriving together with a common prefix share it from their first step on.
        """
        budget = self.max_prefill_tokens
        scheduled = []
        self._scheduled_rows = 0  # rows of the step (forks' included): decode-only needs one per sequence
        self._sampling: list[_Sequence] = []  # the scheduled sequences whose last row is in the step, in order
        sampling = self._sampling
        prompts: dict[tuple[int, ...], _Sequence] = {}  # fresh prompts this step computes through their last row
        hashed: dict[tuple[int, ...], list[bytes]] = {}  # fresh prompts admitted this step -> their blocks' digests

        def add(seq: _Sequence, n: int) -> bool:
            try:
                self._grow(seq, seq.num_computed + n)
            except Exception as exc:  # noqa: BLE001 - one request's failure must not end the others
                logger.exception("engine: scheduling request %s failed", seq.req.rid)
                if seq.inflight:
                    self._failed_later.append((seq, exc))  # ended once its token in flight is read
                else:
                    self._fail(seq, exc)
                return False
            scheduled.append((seq, n))
            self._scheduled_rows += n
            if seq.num_computed + n == len(seq.tokens):
                sampling.append(seq)
            return True

        self._schedules += 1
        self._chain = 1
        head = self._queue[0] if self._queue else None
        if head is not None and head.failures and len(self._running) < self.max_running_requests and self._admit(head):
            # A request suspected of breaking a batch runs its next step alone; running requests wait one step.
            self._queue.popleft()
            self._running.append(head)
            self._plan = None
            add(head, min(len(head.tokens) - head.num_computed, budget))
            return scheduled
        bs, decode_rows = self.block_size, 0
        planned = self._planned_rows()
        if planned is not None:
            scheduled += [(seq, 1) for seq in planned]
            sampling += planned
            decode_rows = len(planned)
        else:
            all_decode, spans = True, []
            for seq in list(self._running):
                if _last_in_flight(seq):
                    all_decode = False
                    continue
                pending = len(seq.tokens) - seq.num_computed
                if pending == 1:
                    # What add() does when the row has its block and completes no block whose tokens the host has (most
                    # decode rows; a row that fills a block while its token is in flight registers the block later).
                    span = steady_steps(seq, bs)
                    if span > 0:
                        scheduled.append((seq, 1))
                        sampling.append(seq)
                        decode_rows += 1
                    elif add(seq, 1):
                        span = steady_steps(seq, bs)  # with its next block
                    else:
                        all_decode = False
                    spans.append(span)
                    continue
                all_decode = False
                n = min(pending, budget)
                if n > 0:
                    budget -= n
                    add(seq, n)
            if all_decode and self._running:
                self._plan = DecodePlan.build(self._running, spans, self._schedules)
                # Chains replay the decode graph and its sampling: not with per-step replay copies, streams or the
                # batch-invariant (true on-policy) sampling.
                copies = not self.cache.keep_topk
                self._plan.chainable = (self.num_continuous_decode_steps > 1 and self.decoder is not None
                                        and not invariant.is_enabled() and not any(
                                            seq.req.stream or (seq.req.return_indexer_topk and copies)
                                            for seq in self._running))
        self._scheduled_rows += decode_rows
        while self._queue and len(self._running) < self.max_running_requests:
            seq = self._queue[0]
            key = tuple(seq.tokens) if seq.num_output == 0 and self.blocks.enable_prefix_caching else None
            twin = prompts.get(key) if key is not None else None
            if (budget <= 0 and twin is None) or seq.failures or not self._admit(seq, hashed.get(key)):
                break
            if key is not None and key not in hashed:  # the group's other samples reuse them (GRPO's n samples)
                hashed[key] = list(seq.digests)
            self._queue.popleft()
            self._running.append(seq)
            self._plan = None
            n = len(seq.tokens) - seq.num_computed
            if twin is not None:
                # Same prompt as a request computed in this step (GRPO's n samples): copy its rows, sample from
                # its last row. Prefix caching shares full blocks only; this also covers the partial last block.
                self._forks[seq] = twin
                seq.cached_tokens += n
                self.stats["cached_tokens"] += n
            else:
                n = min(n, budget)
                budget -= n
            if add(seq, n) and twin is None and key is not None and seq.num_computed + n == len(seq.tokens):
                prompts[key] = seq
        return scheduled

    def _planned_rows(self) -> list[_Sequence] | None:
        """This step's decode rows from the plan (decode_plan.py): every running sequence, with only the rows whose span
        ends checked (and given their next block); None when the plan is gone or a checked row is no longer a plain
        decode row (the caller then tests every request, as the plan does, and the blocks grown here stay grown)."""
        plan = self._plan
        if plan is None:
            return None
        if len(plan.rows) != len(self._running):  # cannot happen (every change of the list keeps or drops the plan)
            self._plan = None
            return None
        step, bs = self._schedules, self.block_size
        # Several steps a launch: the rows whose span ends within them are checked now, and given the blocks for all
        # of them; rows past their span's end stay plain decode rows throughout.
        chain = (self.num_continuous_decode_steps if plan.chainable and not self._queue and not self._scoring else 1)
        due = plan.due(step + chain - 1)
        for row in due:
            seq = plan.rows[row]
            if len(seq.tokens) - seq.num_computed != 1 or _last_in_flight(seq):
                self._plan = None
                return None
            if seq.stop.max_new_tokens - (len(seq.tokens) - seq.prompt_len) < chain:
                chain = 1  # it would sample past its limit: one step this time
        for row in due:
            seq = plan.rows[row]
            if len(seq.blocks) * bs - seq.num_computed < chain:  # its blocks end within the launch's steps
                try:
                    self._grow(seq, seq.num_computed + chain)
                except Exception:  # noqa: BLE001 - the full pass meets it again and ends that request alone
                    self._plan = None
                    return None
            plan.checked(row, step, bs)
        if due:
            plan.refresh()
        self._chain = chain
        return plan.rows

    def _admit(self, seq: _Sequence, digests: list[bytes] | None = None) -> bool:
        """Take the cached prefix and reserve the rest of the request's blocks, if the budget allows. `digests`: those
        of the same tokens' blocks, hashed for an earlier request."""
        bs = self.block_size
        rows = len(seq.tokens) + (seq.max_new_tokens - seq.num_output) - 1
        need = -(-rows // bs)
        # At least the last input token is recomputed: its row produces the next token's logits.
        full = (len(seq.tokens) - 1) // bs
        seq.digests = list(digests) if digests is not None else block_digests(seq.tokens, bs, full)
        matched = self.blocks.match(seq.digests)
        if need - len(matched) + self.blocks.cost_of(matched) > self.blocks.available:
            return False
        self.blocks.acquire(matched)
        self.blocks.reserve(need - len(matched))
        seq.blocks, seq.reserved = list(matched), need - len(matched)
        self._tables_epoch += 1
        seq.num_computed = seq.num_registered = len(matched)
        seq.num_computed *= bs
        seq.cached_tokens += seq.num_computed
        seq.cache_epoch = self._cache_epoch
        self.stats["cached_tokens"] += seq.num_computed
        return True

    def _grow(self, seq: _Sequence, rows: int) -> None:
        """Give the sequence blocks for `rows` rows and offer its newly full blocks to the prefix cache."""
        bs = self.block_size
        while len(seq.blocks) * bs < rows:
            if seq.reserved <= 0:  # taking a block anyway would take another request's
                raise RuntimeError(f"request {seq.req.rid} needs more cache blocks than it reserved ({len(seq.blocks)})")
            seq.blocks.append(self.blocks.allocate())
            seq.reserved -= 1
        self._register(seq, rows)

    def _register(self, seq: _Sequence, rows: int) -> None:
        """Offer the sequence's full blocks of its first `rows` rows to the prefix cache, those whose tokens the host
        has (a block holding a token in flight waits for the step that reads it)."""
        bs = self.block_size
        if rows // bs <= seq.num_registered:  # most calls: no block filled up
            return
        full = min(rows, len(seq.tokens) - seq.inflight) // bs
        if full <= seq.num_registered:
            return
        if seq.cache_epoch == self._cache_epoch:
            if len(seq.digests) < full:
                parent = seq.digests[-1] if seq.digests else b""
                seq.digests += block_digests(seq.tokens, bs, full, start=len(seq.digests), parent=parent)
            for i in range(seq.num_registered, full):
                if self.blocks.register(seq.blocks[i], seq.digests[i]):
                    self._step_registered.append(seq.blocks[i])
        seq.num_registered = full

    def _launch(self, scheduled: list[tuple[_Sequence, int]], previous: _Launched | None) -> _Launched:
        """Queue this step's forward and the sampling of its last rows on the device, and the copy of the results to
        the host; nothing here waits for the device (on CPU the work runs here). Inputs sampled by `previous` and not
        yet on the host are fed from its device tokens. Each sampling sequence gets an IN_FLIGHT token."""
        device = self.device
        seqs = self._sampling  # the rows that sample (_schedule)
        # With kept selections the replay rows are read from the cache when a request ends; else each step's here.
        want_topk = not self.cache.keep_topk and any(seq.req.return_indexer_topk for seq in seqs)
        # Every sequence adds one row (n >= 1 each) and samples from it.
        decode_only = not self._forks and self._scheduled_rows == len(scheduled) == len(seqs)
        key = tuple([seq.serial for seq in seqs])
        # Each launch adds one token to each row that samples, so the same rows as the last launch have one more each.
        last = self._last_counts
        same_rows = last is not None and last[0] == key
        # Rows left or joined since (requests ended, were admitted): each row's row in the last launch, -1 if new.
        moved = None
        if last is not None and not same_rows:
            moved = _rows_in(last[0], key)
        kept = moved is not None and len(moved) and moved.min() >= 0  # only rows of the last launch
        positions = None
        on_host = device.type != "cuda"
        begin = torch.cuda.Event(enable_timing=True) if not on_host else None
        done = None

        def on_inputs(ids: torch.Tensor, fed: list[int] | range | np.ndarray, fed_seqs: list[_Sequence] | None) -> None:
            """The input ids are queued on the device: the step's device work starts here."""
            if begin is not None:
                begin.record()
            if len(fed):
                self._feed(ids, fed, fed_seqs, previous.last)

        forward_start = time.perf_counter()
        tables_key = None
        paged = decode_only and self.decoder is not None
        if paged:
            self.stats["paged_decode_steps"] += 1
            tables_key = (key, self._tables_epoch)
            # Rows of the last launch only, which was a paged decode step: its block table rows, picked and grown.
            rows_from = (last[3], moved) if kept and last[3] is not None else None
            if previous is not None and same_rows:  # overlap: every input is `previous`'s token, in the same rows
                fed, input_ids = range(len(seqs)), [IN_FLIGHT_INPUT] * len(seqs)
            elif previous is not None and kept:  # overlap: every input is `previous`'s token, at its row `moved`
                fed, input_ids = moved, [IN_FLIGHT_INPUT] * len(seqs)
            else:
                fed = [b for b, seq in enumerate(seqs) if seq.inflight] if previous is not None else []
                input_ids = ([IN_FLIGHT_INPUT if seq.inflight else seq.tokens[-1] for seq in seqs] if fed
                             else [seq.tokens[-1] for seq in seqs])
            if same_rows and last[2] is not None:  # the same rows decoded one token each last step
                positions = last[2] + 1
            elif kept and last[2] is not None:
                positions = last[2][moved] + 1
            else:
                positions = np.fromiter((seq.num_computed for seq in seqs), dtype=np.int64, count=len(seqs))
            hidden, topk_all, write_slots = self.decoder.forward(
                input_ids, positions, [seq.blocks for seq in seqs],
                on_inputs=lambda ids: on_inputs(ids, fed, None if isinstance(fed, (range, np.ndarray))
                                                else [seqs[b] for b in fed]),
                tables_key=tables_key, rows_from=rows_from,
            )
            if self.cache.keep_topk and topk_all is not None:
                self.cache.store_topk(write_slots, topk_all)
        else:
            hidden, topk_all = self._forward_packed(scheduled, want_topk, on_inputs)
        tokens = result = topk_host = rows = None
        wanted: list[int] = []
        if seqs:
            n = len(seqs)
            rows = self._sampling_rows(key, seqs, moved)
            if same_rows:
                num_output = last[1]  # (B,) tokens before this one: the last launch's counts with its token
            elif kept:
                num_output = last[1][upload(torch.from_numpy(moved), device)]
            else:
                num_output = upload(torch.from_numpy(np.fromiter((len(seq.tokens) - seq.prompt_len for seq in seqs),
                                                                 dtype=np.int64, count=n)), device)
            result, tokens, count = self._sample(hidden, rows, num_output, seqs, paged, follows=same_rows or kept)
            if want_topk:
                wanted = [b for b, seq in enumerate(seqs) if seq.req.return_indexer_topk]
                picked = upload(torch.tensor(wanted), device) if len(wanted) < len(seqs) else slice(None)
                topk_host = topk_all[:, picked].to(torch.int32).transpose(0, 1)  # (B_wanted, n_full, K) sequence-local
            if not on_host:  # into pinned memory without waiting; `done` says when it is there
                result, topk_host = _to_host_async(result)[:, :n], _to_host_async(topk_host)
        device_s = time.perf_counter() - forward_start if on_host else 0.0
        if not on_host:
            done = torch.cuda.Event(enable_timing=True)
            done.record()
        chain = self._chain if paged else 1  # > 1 only from a chainable plan (_planned_rows)
        followers: list[_Launched] = []
        for j in range(1, chain):
            follower, count = self._launch_next(seqs, scheduled, rows, tokens, count, positions + j)
            followers.append(follower)
            tokens = follower.tokens
        if followers:
            self._schedules += chain - 1  # the decode plan's clock counts steps
            self.stats["steps"] += chain - 1  # each step the device runs counts (perf.py's rates are per step)
            self.stats["paged_decode_steps"] += chain - 1
            self.stats["continued_decode_steps"] += chain - 1
        token_index = []
        if decode_only:  # scheduled and seqs are the same sequences
            placeholders = [IN_FLIGHT] * chain
            for seq in seqs:
                seq.num_computed += chain
                if seq.failures:
                    seq.failures = 0
                seq.tokens += placeholders
                seq.inflight += chain
            token_index = (positions + 1).tolist() if positions is not None else [seq.num_computed for seq in seqs]
        else:
            for seq, n in scheduled:
                seq.num_computed += n
                seq.failures = 0
            for seq in seqs:
                seq.tokens.append(IN_FLIGHT)
                seq.inflight += 1
                token_index.append(len(seq.tokens) - 1)
        launched = _Launched(scheduled=scheduled, sampled=seqs,
                             token_index=token_index, tokens=tokens, result=result, topk=topk_host, wanted=wanted,
                             stream_rows=rows.stream_rows if rows else [],
                             version=self._version_int, decode_only=decode_only, device_s=device_s, begin=begin,
                             done=done, followers=followers)
        if on_host:
            self._account_device(launched)
        if positions is not None and chain > 1:
            positions = positions + (chain - 1)  # the last step's: the next launch's are one on
        self._last_counts = (key, count, positions if decode_only else None, tables_key) if seqs else None
        return launched

    def _sample(self, hidden: torch.Tensor, rows: SamplingRows, num_output: torch.Tensor, seqs: list[_Sequence],
                paged: bool, follows: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One token per row from the step's final hidden states -> (result (3, n) on the device, tokens (n,), output
        counts with them (n,)); `follows`: num_output is the last sampling's counts (SamplingRows.uniforms)."""
        n, table = len(seqs), self._completer_table.table
        if paged and self.decoder.samples_in_graph(n, len(hidden)) and not invariant.is_enabled():
            # The forward ran from a graph: its sampling does too, over the bucket's rows (hidden is padded).
            graphed = self.decoder.sample(hidden, rows, num_output, table)
            if graphed is not None:
                result, tokens, count = graphed
                rows.drop_draws()  # served from the hash here: draws made ahead would be a step behind
                return result, tokens[:n], count[:n]
        # Over the bucket's rows on a paged step, as the graph's (the same GEMM shapes: the same bits).
        logits = self.model.lm_head(hidden).float()[:n]  # (n, V)
        uniforms = rows.uniforms(num_output, follows=follows, dtype=logits.dtype)
        # True on-policy: the trainer's op, so its log-probs equal these bit for bit.
        exact = ([1.0 if seq.req.sampling.greedy else float(seq.req.sampling.temperature) for seq in seqs]
                 if invariant.is_enabled() else None)
        return sample_rows(logits, rows, num_output, uniforms, table, exact)

    def _launch_next(self, seqs: list[_Sequence], scheduled: list[tuple[_Sequence, int]], rows: SamplingRows,
                     tokens: torch.Tensor, num_output: torch.Tensor,
                     positions: np.ndarray) -> tuple[_Launched, torch.Tensor]:
        """Queue the decode step after the one that sampled `tokens` (with output counts `num_output`) over the same
        rows, fed those tokens on the device (a launch of several steps); `positions`: this step's input positions.
        Returns the step and its rows' output counts with its tokens."""
        on_host = self.device.type != "cuda"
        start = time.perf_counter()
        begin = done = None
        if not on_host:
            begin = torch.cuda.Event(enable_timing=True)
            begin.record()
        hidden, topk_all, write_slots = self.decoder.forward_next(tokens)
        if self.cache.keep_topk and topk_all is not None:
            self.cache.store_topk(write_slots, topk_all)
        result, tokens, count = self._sample(hidden, rows, num_output, seqs, True, follows=True)
        if not on_host:
            result = _to_host_async(result)[:, : len(seqs)]
            done = torch.cuda.Event(enable_timing=True)
            done.record()
        launched = _Launched(scheduled=scheduled, sampled=seqs, token_index=(positions + 1).tolist(), tokens=tokens,
                             result=result, topk=None, wanted=[], stream_rows=[], version=self._version_int,
                             decode_only=True, device_s=time.perf_counter() - start if on_host else 0.0, begin=begin,
                             done=done)
        if on_host:
            self._account_device(launched)
        return launched, count

    def _feed(self, ids: torch.Tensor, rows: list[int] | range | np.ndarray, seqs: list[_Sequence] | None,
              previous: _Launched) -> None:
        """ids[rows] = the tokens `previous` sampled for `seqs`, on the device (the host does not have them yet);
        `seqs` None: every row is fed, rows is range(B) (`previous`'s rows in its order) or, as an array, each row's
        row in `previous`."""
        if seqs is None:
            if isinstance(rows, range):
                ids[: len(rows)].copy_(previous.tokens)
            else:
                ids[: len(rows)].copy_(previous.tokens.index_select(0, upload(torch.from_numpy(rows), self.device)))
            return
        src = [previous.row_of[seq] for seq in seqs]
        n = len(previous.sampled)
        if rows == src == list(range(n)):  # the common case: the same requests in the same order
            ids[:n].copy_(previous.tokens)
            return
        index = upload(torch.tensor(rows + src, dtype=torch.long), self.device)
        ids.index_copy_(0, index[: len(rows)], previous.tokens.index_select(0, index[len(rows) :]))

    def _sampling_rows(self, key: tuple[int, ...], seqs: list[_Sequence], moved: np.ndarray | None = None) -> SamplingRows:
        """The device tensors of these rows (`key`: their serials), updated from the last step's (rows.py); `moved`:
        each row's row in the last launch (-1: new), when that launch's rows are these rows' source."""
        if self._rows is None:
            self._rows = SamplingRows.build(key, [seq.row for seq in seqs], self.device)
        elif self._rows.key != key:
            last = self._last_counts
            known = moved if last is not None and last[0] == self._rows.key else None
            self._rows = self._rows.update(key, [seq.row for seq in seqs], known)
        return self._rows

    def _forward_packed(self, scheduled: list[tuple[_Sequence, int]], want_topk: bool,
                        on_inputs: Callable[[torch.Tensor, list[int], list[_Sequence]], None]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Any mix of prefill chunks and decode rows in one packed forward, keys gathered from the cache; decode rows
        whose input is in flight get it on the device (`on_inputs(ids, rows, their sequences)`, before the forward).

        Returns the final hidden states of the rows that sample (B, D) and their top-k (n_full, B, K) or None.
        Forked sequences (self._forks) add no rows: their new cache rows are copied from their twin's after the
        forward, and they sample from their twin's last row.
        """
        bs, device = self.block_size, self.device
        everything, scheduled = scheduled, [(seq, n) for seq, n in scheduled if seq not in self._forks]
        S = len(scheduled)
        lens_q = np.fromiter((n for _, n in scheduled), dtype=np.int64, count=S)
        starts = np.fromiter((seq.num_computed for seq, _ in scheduled), dtype=np.int64, count=S)
        lens_k = starts + lens_q
        max_blocks = max(len(seq.blocks) for seq, _ in scheduled)
        table = np.zeros((S, max_blocks), dtype=np.int64)
        for i, (seq, _) in enumerate(scheduled):
            table[i, : len(seq.blocks)] = seq.blocks
        input_ids = np.fromiter(
            (t for seq, n in scheduled for t in seq.tokens[seq.num_computed : seq.num_computed + n]), dtype=np.int64, count=int(lens_q.sum())
        )
        Tq, Tk = len(input_ids), int(lens_k.sum())
        row_ends = np.cumsum(lens_q)
        fed = [i for i, (seq, _) in enumerate(scheduled) if seq.inflight]  # decode rows (n == 1) whose input is in flight
        fed_rows = [int(row_ends[i]) - 1 for i in fed]
        input_ids[fed_rows] = IN_FLIGHT_INPUT
        last_row_of = {seq: int(row_ends[i]) - 1 for i, (seq, n) in enumerate(scheduled)
                       if seq.num_computed + n == len(seq.tokens)}
        # Every sequence that samples this step, in scheduled order, and the query row it samples from.
        sampled = [(i, seq) for i, (seq, n) in enumerate(everything) if seq.num_computed + n == len(seq.tokens)]
        last_rows = np.array([last_row_of[self._forks.get(seq, seq)] for _, seq in sampled], dtype=np.int64)
        # One host-to-device copy for all step metadata (pinned: a pageable copy would wait for the device).
        packed = torch.from_numpy(np.concatenate([input_ids, starts, lens_q, lens_k, last_rows, table.reshape(-1)]))
        if device.type == "cuda":
            packed = packed.pin_memory()
        packed = packed.to(device, non_blocking=True)
        ids_d, starts_d, lens_q_d, lens_k_d, last_rows_d, table_d = packed.split([Tq, S, S, S, len(last_rows), S * max_blocks])
        table_d = table_d.view(S, max_blocks)
        on_inputs(ids_d, fed_rows, [scheduled[i][0] for i in fed])
        zero = torch.zeros(1, dtype=torch.long, device=device)
        cu_q, cu_k = torch.cat([zero, lens_q_d.cumsum(0)]), torch.cat([zero, lens_k_d.cumsum(0)])
        seq_ids = torch.arange(S, device=device)
        q_seq = torch.repeat_interleave(seq_ids, lens_q_d, output_size=Tq)  # (Tq,) sequence of each query row
        positions = torch.arange(Tq, device=device) - cu_q[q_seq] + starts_d[q_seq]
        write_slots = table_d[q_seq, positions // bs] * bs + positions % bs
        read_slots = None
        if bool(starts.any()):  # some keys come from the cache: gather all of them
            k_seq = torch.repeat_interleave(seq_ids, lens_k_d, output_size=Tk)
            k_pos = torch.arange(Tk, device=device) - cu_k[k_seq]
            read_slots = table_d[k_seq, k_pos // bs] * bs + k_pos % bs
        host_cu = ([0, *row_ends.tolist()], [0, *np.cumsum(lens_k).tolist()])
        batch = PackedBatch(positions=positions, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                            kv_cache=self.cache.bind(write_slots, read_slots), host_cu_seqlens=host_cu)
        keep = self.cache.keep_topk
        out = self.model.forward_packed(ids_d, batch, return_logits=False, return_topk=want_topk or keep)
        if keep:
            self.cache.store_topk(write_slots, out.topk_indices)
        if self._forks:
            self._copy_fork_rows(everything)  # after store_topk: the kept selections are copied too
        self.stats["prefill_tokens"] += int(Tq - sum(1 for seq, n in scheduled if n == 1 and seq.num_output > 0))
        topk = out.topk_indices[:, last_rows_d] if want_topk else None
        return out.hidden_states[last_rows_d], topk

    def _topk_first(self, seq: _Sequence) -> int:
        """The first sequence row whose selection the request gets: P-1 (output rows only) or from its start_len on,
        skipping rows below index_topk (they select every causal key, so any top-k agrees on them)."""
        start_len = seq.req.indexer_topk_start_len
        return seq.prompt_len - 1 if start_len < 0 else max(start_len, self.config.index_topk)

    def _copy_fork_rows(self, scheduled: list[tuple[_Sequence, int]]) -> None:
        """Fill each forked sequence's new cache rows with its twin's (same tokens, same positions, same weights)."""
        bs = self.block_size
        forks = [(seq, self._forks[seq], n) for seq, n in scheduled if n > 0 and seq in self._forks]
        if not forks:
            return
        # Vectorised over rows (a step forks ~1,000 sequences): the blocks holding each fork's new rows, and the
        # twin's at the same indices, flattened; then every row's slot in both.
        starts = np.fromiter((seq.num_computed for seq, _, _ in forks), dtype=np.int64, count=len(forks))
        counts = np.fromiter((n for _, _, n in forks), dtype=np.int64, count=len(forks))
        first, end = starts // bs, (starts + counts - 1) // bs + 1
        spans = list(zip(first.tolist(), end.tolist()))
        fork_blocks = np.fromiter(itertools.chain.from_iterable(
            seq.blocks[a:b] for (seq, _, _), (a, b) in zip(forks, spans)), dtype=np.int64)
        twin_blocks = np.fromiter(itertools.chain.from_iterable(
            twin.blocks[a:b] for (_, twin, _), (a, b) in zip(forks, spans)), dtype=np.int64)
        positions = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts - starts, counts)
        flat = np.repeat(np.cumsum(end - first) - end, counts) + positions // bs  # into the flattened blocks
        src = twin_blocks[flat] * bs + positions % bs
        dst = fork_blocks[flat] * bs + positions % bs
        self.cache.copy_rows(upload(torch.from_numpy(src), self.device), upload(torch.from_numpy(dst), self.device))

    # -- finishing, retracting, failures --------------------------------------------------------

    def _topk_range(self, seq: _Sequence) -> tuple[int, int]:
        """The sequence rows [first, end) whose selections the final output carries (empty before a first token)."""
        P, R = seq.prompt_len, seq.num_output
        if R == 0:
            return P - 1, P - 1
        return min(self._topk_first(seq), P - 1 + R), P - 1 + R

    def _topk_rows(self, seqs: list[_Sequence]) -> list[tuple[np.ndarray, int]]:
        """Each sequence's (selections of its rows first .. end-1 as (rows, n_full, K) int32, first), for its final
        output: from the per-step copies, or with kept_topk from the cache pool, one read for all of them."""
        shape = (0, self.n_full_layers, self.config.index_topk)
        if not self.cache.keep_topk:
            P = [seq.prompt_len for seq in seqs]
            return [(np.stack(seq.topk) if seq.topk else np.zeros(shape, dtype=np.int32), p - 1) for seq, p in zip(seqs, P)]
        ranges = [self._topk_range(seq) for seq in seqs]
        pooled = self._read_kept_topk([(seq, first + _rows(seq.retracted_topk), end)
                                       for seq, (first, end) in zip(seqs, ranges)])
        out = []
        for seq, (first, end), rows in zip(seqs, ranges, pooled):
            if end <= first:
                out.append((np.zeros(shape, dtype=np.int32), first))
            else:
                parts = [r for r in (seq.retracted_topk, rows) if r is not None and len(r)]
                out.append((parts[0] if len(parts) == 1 else np.concatenate(parts)[: end - first], first))
        return out

    def _read_kept_topk(self, spans: list[tuple[_Sequence, int, int]]) -> list[np.ndarray | None]:
        """The kept selections of rows [start, end) of each sequence, from its cache blocks: (rows, n_full, K) int32
        each (None where the span is empty), in one read."""
        bs, n = self.block_size, len(spans)
        starts = np.fromiter((start for _, start, _ in spans), dtype=np.int64, count=n)
        sizes = np.maximum(np.fromiter((end for _, _, end in spans), dtype=np.int64, count=n) - starts, 0)
        total = int(sizes.sum())
        if not total:
            return [None] * n
        # All spans' rows at once: row r of span i is in block blocks_i[r // bs], found in the spans' blocks laid end
        # to end.
        num_blocks = np.fromiter((len(seq.blocks) for seq, _, _ in spans), dtype=np.int64, count=n)
        blocks = np.fromiter(itertools.chain.from_iterable(seq.blocks for seq, _, _ in spans), dtype=np.int64,
                             count=int(num_blocks.sum()))
        span = np.repeat(np.arange(n), sizes)
        r = np.arange(total) - np.repeat(np.cumsum(sizes) - sizes, sizes) + starts[span]
        if (r // bs >= num_blocks[span]).any():
            raise IndexError("a replay row past its sequence's blocks")
        slots = blocks[(np.cumsum(num_blocks) - num_blocks)[span] + r // bs] * bs + r % bs
        # These rows come from steps the host has read already. On CUDA a side stream reads them, so this waits for
        # that read only, not for a step in flight on the main stream (which writes other rows: overlap).
        # Contiguous per request, so the response encodes each part without another copy; on CUDA into pinned memory
        # (a pageable copy of this size, hundreds of MiB when a large batch ends together, runs at a fraction of it).
        with self._side_stream():
            rows = self.cache.read_topk(upload(torch.from_numpy(slots), self.device))  # (S, n_full, K)
            if rows.device.type == "cuda":
                rows = _to_host_async(rows)
                torch.cuda.current_stream(self.device).synchronize()  # the side stream: this read only
            parts = np.split(rows.numpy(), np.cumsum(sizes)[:-1])
        return [part if k else None for part, k in zip(parts, sizes.tolist())]

    def _side_stream(self) -> Any:
        """A context on the engine's second CUDA stream (nothing on CPU)."""
        if self.device.type != "cuda":
            return contextlib.nullcontext()
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        return torch.cuda.stream(self._stream)

    def _output(self, seq: _Sequence, final: bool = False, topk: tuple[np.ndarray, int] | None = None) -> GenerateOutput:
        """The request's state; `final` adds, when asked for, its index replay rows (`topk`, else read here). The text
        is left to the response (rollout.server.protocol.response_text): decoding it here would hold up the step."""
        if final and seq.req.return_indexer_topk and topk is None:
            topk = self._topk_rows([seq])[0]
        topk, topk_start = topk if final and topk is not None else (None, None)
        return GenerateOutput(
            rid=seq.req.rid,
            output_ids=seq.output_ids,
            output_token_logprobs=list(seq.logprobs),
            output_token_versions=seq.versions,
            finish_reason=seq.finish_reason,
            prompt_tokens=seq.prompt_len,
            cached_tokens=seq.cached_tokens,
            weight_version=self._weight_version,
            indexer_topk=topk,
            indexer_topk_start=topk_start,
        )

    def _free(self, seq: _Sequence) -> None:
        self.blocks.release(seq.blocks)
        self.blocks.unreserve(seq.reserved)
        seq.blocks, seq.reserved, seq.num_computed, seq.num_registered, seq.digests = [], 0, 0, 0, []
        self._tables_epoch += 1

    def _finish(self, seq: _Sequence, reason: dict) -> GenerateOutput:
        return self._finish_all([(seq, reason)])[0]

    def _finish_all(self, ending: list[tuple[_Sequence, dict]]) -> list[GenerateOutput]:
        """End these sequences with their finish reasons; their final outputs. Replay rows are read before the
        blocks are freed, for all of them at once."""
        if not ending:
            return []
        for seq, _ in ending:  # a token in flight for a request that ends now is not its
            if seq.inflight:
                del seq.tokens[len(seq.tokens) - seq.inflight :]
                seq.inflight = 0
        wanting = [seq for seq, _ in ending if seq.req.return_indexer_topk]
        try:
            topk = dict(zip(wanting, self._topk_rows(wanting))) if wanting else {}
        except Exception:  # noqa: BLE001 - e.g. a device error: each output then reads (and fails) alone
            logger.exception("engine: reading the replay rows of %d requests failed", len(wanting))
            topk = {}
        outputs = []
        for seq, reason in ending:
            seq.finish_reason = reason
            try:
                outputs.append(self._output(seq, final=True, topk=topk.get(seq)))
            except Exception as exc:  # noqa: BLE001 - a tokenizer failure must still deliver the final state
                logger.exception("engine: final output of request %s failed", seq.req.rid)
                seq.finish_reason = {"type": "abort", "message": f"final output failed: {type(exc).__name__}: {exc}"}
                outputs.append(self._output(seq))
        running = self._leave_running([seq for seq, _ in ending])
        for seq in running:
            self._free(seq)
        for seq, _ in ending:
            self._active.pop(seq.req.rid, None)
            if seq in self._queue:
                self._queue.remove(seq)
        return outputs

    def _leave_running(self, ending: list[_Sequence]) -> list[_Sequence]:
        """Take the running ones of `ending` (each has its finish reason now, and no other running one has) out of the
        running list; returns them in running order. A few are found by C-level searches, many in one pass."""
        plan = self._plan  # its rows are the running list's while it lasts: they leave with it
        if len(ending) > 16:
            kept, running = [], []
            for seq in self._running:
                (kept if seq.finish_reason is None else running).append(seq)
            if running:
                if plan is not None:
                    plan.keep(np.fromiter((seq.finish_reason is None for seq in self._running), dtype=bool,
                                          count=len(self._running)))
                self._running = kept
            return running
        where = []
        for seq in ending:
            try:
                where.append(self._running.index(seq))  # identity: _Sequence compares by `is`
            except ValueError:  # queued, not running
                pass
        where = sorted(set(where))
        running = [self._running[i] for i in where]
        for i in reversed(where):
            del self._running[i]
        if plan is not None and where:
            plan.remove(where)
        return running

    def _fail(self, seq: _Sequence, exc: Exception) -> GenerateOutput:
        """End one request with finish_reason abort and the error; blocks it offered this step are not trusted."""
        for block in seq.blocks:
            if block in self._step_registered:
                self.blocks.forget(block)
        out = self._finish(seq, {"type": "abort", "message": f"engine error: {type(exc).__name__}: {exc}"})
        self._ready.append(out)
        return out

    def _retract(self, seq: _Sequence) -> None:
        """Back to the front of the queue without cache; generated tokens are kept (and so are the draws: they hash the
        seed and the token index), and so are the kept replay rows computed so far (their first computation counts)."""
        if self.cache.keep_topk and seq.req.return_indexer_topk:
            first = self._topk_first(seq)
            (rows,) = self._read_kept_topk([(seq, first + _rows(seq.retracted_topk), seq.num_computed)])
            if rows is not None:
                seq.retracted_topk = rows if seq.retracted_topk is None else np.concatenate([seq.retracted_topk, rows])
        self._free(seq)
        self._queue.appendleft(seq)

    def _recover(self, scheduled: list[tuple[_Sequence, int]], exc: Exception) -> list[GenerateOutput]:
        """A failed forward: requeue the batch to run each suspect alone; a request that fails alone is aborted."""
        for block in self._step_registered:
            self.blocks.forget(block)  # its rows were never (fully) written
        outputs = []
        message = f"engine error: {type(exc).__name__}: {exc}"
        retract = []
        for seq, _ in scheduled:
            if seq.failures or len(scheduled) == 1:
                outputs.append(self._finish(seq, {"type": "abort", "message": message}))
            else:
                seq.failures += 1
                retract.append(seq)
        for seq in reversed(retract):
            self._running.remove(seq)
            self._retract(seq)
        return outputs


_heap_frozen = False


def index_key_dtype(name: str) -> torch.dtype | None:
    """The cache dtype of an engine's index_key_cache_dtype: None keeps the model's."""
    if name not in INDEX_KEY_CACHE_DTYPES:
        raise ValueError(f"index_key_cache_dtype must be one of {INDEX_KEY_CACHE_DTYPES}, got {name!r}")
    if name == "auto":
        return None
    if invariant.is_enabled():
        raise ValueError("index_key_cache_dtype fp8_e4m3 cannot run with batch-invariant ops (true on-policy): the "
                         "trainer scores index keys in the model's dtype")
    return FP8_DTYPE


def _freeze_heap_once() -> None:
    """Move what exists now (imported modules, the model) out of the garbage collector's sight, once per process:
    a full collection then scans only what came later. Unfrozen, one took ~200 ms in a CPU step loop at batch 256.
    Collected first, so no garbage is frozen with it."""
    global _heap_frozen
    if not _heap_frozen:
        freeze_after_startup("engine")
        _heap_frozen = True


def _last_in_flight(seq: _Sequence) -> bool:
    """Its token in flight is its last (num_output >= max_new_tokens, without the properties' calls): no step."""
    return bool(seq.inflight) and len(seq.tokens) - seq.prompt_len >= seq.stop.max_new_tokens


def _same_but_seed(a: GenerateRequest, b: GenerateRequest) -> bool:
    """Whether b's checks, stop rules and sampling row are a's: the same prompt, sampling parameters apart from the
    seed, and the flags those depend on (b not a scoring request)."""
    if (a.input_ids != b.input_ids or a.stream != b.stream or a.return_indexer_topk != b.return_indexer_topk
            or a.indexer_topk_start_len != b.indexer_topk_start_len or b.scores_input):
        return False
    sa, sb = a.sampling, b.sampling
    return sa == sb if sa.sampling_seed == sb.sampling_seed else {**vars(sa), "sampling_seed": None} == {
        **vars(sb), "sampling_seed": None}


def _tail(seq: _Sequence) -> list[int]:
    """The output tokens a stop string can end in (stop.py's window), without copying the whole output or taking
    tokens in flight."""
    end = len(seq.tokens) - seq.inflight
    return seq.tokens[max(seq.prompt_len, end - seq.stop.window) : end]


def _to_host_async(t: torch.Tensor | None) -> torch.Tensor | None:
    """A pinned host copy of a device tensor, queued on the stream (read it once the stream has passed the copy)."""
    if t is None:
        return None
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host


def _rows_in(before: tuple[int, ...], after: tuple[int, ...]) -> np.ndarray:
    """Each serial of `after`'s row in `before`, -1 where it is new. Serials run in admission order, so `before` is
    nearly always ascending: a binary search then, a dict otherwise (a retracted request came back first)."""
    old = np.fromiter(before, dtype=np.int64, count=len(before))
    new = np.fromiter(after, dtype=np.int64, count=len(after))
    if len(old) and (len(old) == 1 or bool((old[1:] > old[:-1]).all())):
        at = np.minimum(np.searchsorted(old, new), len(old) - 1)
        return np.where(old[at] == new, at, -1)
    where = dict(zip(before, range(len(before))))
    return np.fromiter((where.get(serial, -1) for serial in after), dtype=np.int64, count=len(after))


def _rows(array: np.ndarray | None) -> int:
    return 0 if array is None else len(array)


def _next_version(weight_version: str) -> str:
    """The version an update without one gets: the next integer, else the old one marked as updated."""
    try:
        return str(int(weight_version) + 1)
    except ValueError:
        return f"{weight_version}+1"


def _version_number(weight_version: str, fallback: int) -> int:
    """The integer recorded per token: the weight_version itself when it is an integer, else the update count."""
    try:
        return int(weight_version)
    except ValueError:
        return fallback
