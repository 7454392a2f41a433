"""The embedded continuous-batching engine: a synchronous scheduler over a paged MLA KV cache.

One `step()` is one scheduler iteration:
1. every running request that is decoding contributes its one new token; requests still prefilling (a long
   prompt, or one re-prefilled after a retract) contribute a chunk under the `max_prefill_tokens` budget;
2. queued requests are admitted in arrival order while the cache budget, `max_running_requests` and the
   prefill budget allow; each admitted request first takes the longest cached prefix it can (prefix reuse,
   see blocks.py) and then joins this very step with the rest of its prompt;
3. ONE packed forward runs over all of it (`forward_packed` with the cache bound to this step's slots); a
   step where every request decodes one token goes through decode.py instead (no key gather; a CUDA graph
   replay on GPU);
4. the requests whose last input row was in the batch sample one token each, in one batched call;
5. stop rules run on the host, finished requests leave and free their blocks.
The host waits on the device once per step (one `.tolist()` of tokens and log-probs; index replay adds one
copy of the selected indices).

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

import logging
import os
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from rollout.engine.blocks import BlockManager, block_digests
from rollout.engine.decode import PagedDecoder
from rollout.engine.defaults import DEFAULT_BLOCK_SIZE, DEFAULT_MAX_RUNNING_REQUESTS
from rollout.engine.kv_cache import PagedKVCache
from rollout.engine.sampling import SamplingBatch, mask_tokens, sample
from rollout.engine.stop import StopChecker
from rollout.engine.types import GenerateOutput, GenerateRequest, RequestError
from slime_dsa.models import GlmMoeDsaForCausalLM, PackedBatch

logger = logging.getLogger(__name__)

PAUSE_MODES = ("abort", "retract", "in_place")


@dataclass(eq=False)  # identity semantics: sequences are found in lists by `is`, never by value
class _Sequence:
    """Engine-side state of one request."""

    req: GenerateRequest
    tokens: list[int]  # prompt + generated so far
    prompt_len: int
    stop: StopChecker  # owns the request's token limit
    generator: torch.Generator | None
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    topk: list[np.ndarray] = field(default_factory=list)  # per output token (n_full_layers, index_topk)
    prompt_topk: np.ndarray | None = None  # (rows, n_full_layers, index_topk): prompt rows topk_first .. P-2
    blocks: list[int] = field(default_factory=list)  # block table
    digests: list[bytes] = field(default_factory=list)  # of the full blocks known so far
    num_registered: int = 0  # leading blocks already offered to the prefix cache
    num_computed: int = 0  # rows in the cache
    reserved: int = 0  # blocks still promised by the admission reservation
    cache_epoch: int = -1  # prefix-cache generation the sequence was admitted under
    cached_tokens: int = 0
    failures: int = 0
    finish_reason: dict | None = None

    @property
    def output_ids(self) -> list[int]:
        return self.tokens[self.prompt_len :]

    @property
    def num_output(self) -> int:
        return len(self.tokens) - self.prompt_len

    @property
    def max_new_tokens(self) -> int:
        return self.stop.max_new_tokens


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
    ) -> None:
        """paged_decode: decode-only steps read the KV pool in place instead of gathering every sequence's keys
        (on CPU too: 15-20% faster decode with 100-token contexts, benchmarks/RESULTS.md); cuda_graphs: and
        replay them as CUDA graphs (CUDA only); keep_indexer_topk: every cached row's DSA selection is kept, so
        requests may ask for their prompt rows' (exact index replay)."""
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if max_cache_tokens < block_size:
            raise ValueError(f"max_cache_tokens ({max_cache_tokens}) must hold at least one block of block_size ({block_size}) tokens")
        if max_running_requests < 1 or max_prefill_tokens < 1:
            raise ValueError(f"max_running_requests ({max_running_requests}) and max_prefill_tokens ({max_prefill_tokens}) must be >= 1")
        self.model = model.eval()
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
        self.cache = PagedKVCache(self.config, num_blocks, block_size, model.dtype, self.device, keep_topk=keep_indexer_topk)
        self.decoder = PagedDecoder(model, self.cache, block_size, cuda_graphs) if paged_decode else None
        self.n_full_layers = len(self.config.full_layer_ids)
        self._weight_version = str(weight_version)
        self._version_int = _version_number(self._weight_version, 0)
        self._num_updates = 0
        self._cache_epoch = 0
        self._queue: deque[_Sequence] = deque()
        self._running: list[_Sequence] = []
        self._active: dict[str, _Sequence] = {}  # rid -> queued or running sequence
        self._ready: list[GenerateOutput] = []  # finished without a forward (max_new_tokens == 0, a failure)
        self._paused: str | None = None
        self._released: set[str] = set()  # memory tags released for a colocated trainer
        self._step_registered: list[int] = []
        self._forks: dict[int, _Sequence] = {}  # id(seq) -> the sequence of this step whose rows it copies
        self._rng = torch.Generator().manual_seed(int.from_bytes(os.urandom(8), "little") if seed is None else seed)
        self.stats = {"steps": 0, "paged_decode_steps": 0, "prefill_tokens": 0, "generated_tokens": 0, "cached_tokens": 0}
        # Where the step loop's time goes (cumulative; rollout.engine.perf turns two readings into rates): seconds in
        # steps, of them waiting on the device, the same for decode-only steps, and the running requests summed over
        # steps (batch occupancy).
        self.stats.update({"step_s": 0.0, "device_s": 0.0, "decode_steps": 0, "decode_step_s": 0.0,
                           "decode_device_s": 0.0, "running_sum": 0})
        self._step_device_s, self._step_decode_only = 0.0, False
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
        return len(self._queue)

    @property
    def paused(self) -> bool:
        return self._paused is not None

    @property
    def has_work(self) -> bool:
        """Whether `step()` would make progress now."""
        return bool(self._ready) or (self._paused is None and bool(self._running or self._queue))

    # -- requests ---------------------------------------------------------------------------------

    def add_request(self, req: GenerateRequest) -> None:
        """Queue a request; it joins the running batch at the next step that has room. Raises RequestError."""
        seq = self._new_sequence(req)
        if seq.max_new_tokens == 0:
            seq.finish_reason = {"type": "length", "length": 0}
            self._ready.append(self._output(seq))
            return
        self._queue.append(seq)
        self._active[req.rid] = seq

    def _new_sequence(self, req: GenerateRequest) -> _Sequence:
        vocab = self.config.vocab_size
        ids = req.input_ids
        if not isinstance(ids, (list, tuple)) or not ids:
            raise RequestError("input_ids must be a non-empty list of token ids")
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids) or min(ids) < 0 or max(ids) >= vocab:
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
        stop = StopChecker(req.sampling, self.eos_token_ids, self.tokenizer, prompt_len=len(ids), context=context)
        rows = len(ids) + stop.max_new_tokens - 1
        if -(-rows // self.block_size) > self.blocks.num_blocks:
            raise RequestError(
                f"input_ids ({len(ids)} tokens) + sampling_params.max_new_tokens ({stop.max_new_tokens}) need {rows} cache "
                f"tokens, more than the engine's max_cache_tokens ({self.max_cache_tokens})"
            )
        generator = None
        if req.sampling.sampling_seed is not None:
            generator = torch.Generator().manual_seed(req.sampling.sampling_seed)
        return _Sequence(req=req, tokens=list(ids), prompt_len=len(ids), stop=stop, generator=generator)

    def abort(self, rid: str | None = None, abort_all: bool = False, message: str = "aborted by request") -> list[GenerateOutput]:
        """Finish the request `rid` (or all) with finish_reason abort; returns their final outputs."""
        if abort_all:
            targets = list(self._running) + list(self._queue)
        else:
            targets = [self._active[rid]] if rid in self._active else []
        return [self._finish(seq, {"type": "abort", "message": message}) for seq in targets]

    def pause(self, mode: str = "abort") -> list[GenerateOutput]:
        """Stop scheduling. abort: end every request; retract: free running requests' cache and requeue them
        (re-prefilled after resume, generated tokens kept); in_place: keep everything as it is."""
        if mode not in PAUSE_MODES:
            raise RequestError(f"pause mode must be one of {PAUSE_MODES}, got {mode!r}")
        outputs = []
        if mode == "abort":
            outputs = self.abort(abort_all=True, message="aborted by pause_generation")
        elif mode == "retract":
            for seq in reversed(self._running):
                self._retract(seq)
            self._running = []
        self._paused = mode
        return outputs

    def resume(self) -> None:
        self._paused = None

    # -- weights and cache ----------------------------------------------------------------------

    @torch.no_grad()
    def update_weights(self, state_dict: dict[str, torch.Tensor], weight_version: str | None = None, flush_cache: bool = True) -> None:
        """Copy tensors into the model in place (a partial dict updates only those); the prefix cache is flushed.

        All or nothing: names, shapes, dtypes (floating point, cast on copy) and finiteness are checked before
        anything is written (slime_dsa.weights.checks), so a bad dict changes nothing. weight_version, or the next
        version when none is given, is set once all are in. Requests that are running (pause in_place) continue;
        their later tokens report the new version.
        """
        from slime_dsa.weights import WeightFormatError  # noqa: PLC0415
        from slime_dsa.weights.checks import check_update  # noqa: PLC0415

        params = self.model.state_dict(keep_vars=True)
        try:
            check_update(state_dict, params)
        except WeightFormatError as e:
            raise RequestError(f"update_weights: {e}") from None
        for name, tensor in state_dict.items():
            params[name].copy_(tensor)
        self.model.refresh_inference_caches()  # in place: captured decode graphs read these buffers
        self._num_updates += 1
        self._weight_version = str(weight_version) if weight_version is not None else _next_version(self._weight_version)
        self._version_int = _version_number(self._weight_version, self._num_updates)
        if flush_cache:
            self._reset_prefix_cache()
        logger.info("engine: updated %d tensors, weight_version=%s", len(state_dict), self._weight_version)

    def flush_cache(self) -> bool:
        """Drop the prefix cache; refused (False) while requests are running or queued, as SGLang does."""
        if self._running or self._queue:
            return False
        self._reset_prefix_cache()
        return True

    MEMORY_TAGS = ("weights", "kv_cache")

    def release_memory(self, tags: list[str] | None = None) -> None:
        """Free device memory for a colocated trainer: the KV pool and/or the weights (moved to host memory).

        Only while nothing runs or waits; the prefix cache is dropped with the KV pool.
        """
        tags = self._check_memory_tags(tags)
        if "kv_cache" in tags:
            self._reset_prefix_cache()
            self.cache.release()
        if "weights" in tags:
            self.model.drop_inference_caches()
            self.model.to("cpu")
        if self.decoder is not None:
            self.decoder.reset()  # the graphs point at the memory being freed
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        self._released.update(tags)

    def resume_memory(self, tags: list[str] | None = None) -> None:
        """Undo release_memory: weights back on the device, a fresh KV pool."""
        tags = self._check_memory_tags(tags, releasing=False)
        if "weights" in tags:
            self.model.to(self.device)
        if "kv_cache" in tags:
            self.cache.allocate()
        self._released.difference_update(tags)

    def _check_memory_tags(self, tags: list[str] | None, releasing: bool = True) -> list[str]:
        tags = list(self.MEMORY_TAGS if tags is None else tags)
        if bad := [t for t in tags if t not in self.MEMORY_TAGS]:
            raise RequestError(f"tags may hold only {list(self.MEMORY_TAGS)}, got {bad}")
        if releasing and (self._running or self._queue):
            raise RequestError("memory can be released only while no request runs or waits: pause generation first")
        return tags

    def _reset_prefix_cache(self) -> None:
        self.blocks.reset_prefix_cache()
        self._cache_epoch += 1  # running sequences stop offering blocks: their rows mix weight versions

    # -- the scheduler iteration -----------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> list[GenerateOutput]:
        """One scheduler iteration; returns the outputs that changed (cumulative, finish_reason on the last).

        A request with stream=False appears only once, finished."""
        start = time.perf_counter()
        outputs, self._ready = self._ready, []
        if self._paused is not None:
            return outputs
        self._step_registered = []  # blocks offered to the prefix cache by this step
        self._forks = {}
        scheduled = self._schedule()
        outputs, self._ready = outputs + self._ready, []  # requests whose scheduling failed
        if not scheduled:
            return outputs
        self.stats["steps"] += 1
        try:
            tokens, logprobs, topk = self._forward_and_sample(scheduled)
        except Exception as exc:  # noqa: BLE001 - one bad batch must not stop the engine
            logger.exception("engine: step over %d requests failed", len(scheduled))
            return outputs + self._recover(scheduled, exc)
        sampled = [(seq, n) for seq, n in scheduled if seq.num_computed + n == len(seq.tokens)]
        for seq, n in scheduled:
            seq.num_computed += n
            seq.failures = 0
        for j, (seq, _) in enumerate(sampled):
            seq.tokens.append(int(tokens[j]))
            seq.logprobs.append(logprobs[j])
            seq.versions.append(self._version_int)
            if topk is not None and seq.req.return_indexer_topk:
                seq.topk.append(topk[seq.req.rid])
            try:
                reason = seq.stop.check(seq.output_ids)
            except Exception as exc:  # noqa: BLE001 - e.g. a tokenizer error costs this request only
                logger.exception("engine: stop check of request %s failed", seq.req.rid)
                reason = {"type": "abort", "message": f"stop check failed: {type(exc).__name__}: {exc}"}
            if reason:
                outputs.append(self._finish(seq, reason))
            elif seq.req.stream:
                outputs.append(self._output(seq))
        self.stats["generated_tokens"] += len(sampled)
        self._account_step(time.perf_counter() - start, len(scheduled))
        return outputs

    def _account_step(self, seconds: float, running: int) -> None:
        stats = self.stats
        stats["step_s"] += seconds
        stats["device_s"] += self._step_device_s
        stats["running_sum"] += running
        if self._step_decode_only:
            stats["decode_steps"] += 1
            stats["decode_step_s"] += seconds
            stats["decode_device_s"] += self._step_device_s

    def _schedule(self) -> list[tuple[_Sequence, int]]:
        """Pick this step's (sequence, new rows) pairs, admitting queued requests; allocates their blocks.

        Each admitted request grows (and registers its full blocks) before the next is admitted, so requests
        arriving together with a common prefix share it from their first step on.
        """
        budget = self.max_prefill_tokens
        scheduled = []
        prompts: dict[tuple[int, ...], _Sequence] = {}  # fresh prompts this step computes through their last row

        def add(seq: _Sequence, n: int) -> bool:
            try:
                self._grow(seq, seq.num_computed + n)
            except Exception as exc:  # noqa: BLE001 - one request's failure must not end the others
                logger.exception("engine: scheduling request %s failed", seq.req.rid)
                self._fail(seq, exc)
                return False
            scheduled.append((seq, n))
            return True

        head = self._queue[0] if self._queue else None
        if head is not None and head.failures and len(self._running) < self.max_running_requests and self._admit(head):
            # A request suspected of breaking a batch runs its next step alone; running requests wait one step.
            self._queue.popleft()
            self._running.append(head)
            add(head, min(len(head.tokens) - head.num_computed, budget))
            return scheduled
        for seq in list(self._running):
            pending = len(seq.tokens) - seq.num_computed
            n = 1 if pending == 1 else min(pending, budget)
            if n <= 0:
                continue
            if pending > 1:
                budget -= n
            add(seq, n)
        while self._queue and len(self._running) < self.max_running_requests:
            seq = self._queue[0]
            key = tuple(seq.tokens) if seq.num_output == 0 and self.blocks.enable_prefix_caching else None
            twin = prompts.get(key) if key is not None else None
            if (budget <= 0 and twin is None) or seq.failures or not self._admit(seq):
                break
            self._queue.popleft()
            self._running.append(seq)
            n = len(seq.tokens) - seq.num_computed
            if twin is not None:
                # Same prompt as a request computed in this step (GRPO's n samples): copy its rows, sample from
                # its last row. Prefix caching shares full blocks only; this also covers the partial last block.
                self._forks[id(seq)] = twin
                seq.cached_tokens += n
                self.stats["cached_tokens"] += n
            else:
                n = min(n, budget)
                budget -= n
            if add(seq, n) and twin is None and key is not None and seq.num_computed + n == len(seq.tokens):
                prompts[key] = seq
        return scheduled

    def _admit(self, seq: _Sequence) -> bool:
        """Take the cached prefix and reserve the rest of the request's blocks, if the budget allows."""
        bs = self.block_size
        rows = len(seq.tokens) + (seq.max_new_tokens - seq.num_output) - 1
        need = -(-rows // bs)
        # At least the last input token is recomputed: its row produces the next token's logits.
        seq.digests = block_digests(seq.tokens, bs, (len(seq.tokens) - 1) // bs)
        matched = self.blocks.match(seq.digests)
        if need - len(matched) + self.blocks.cost_of(matched) > self.blocks.available:
            return False
        self.blocks.acquire(matched)
        self.blocks.reserve(need - len(matched))
        seq.blocks, seq.reserved = list(matched), need - len(matched)
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
        full = rows // bs
        if full > seq.num_registered and seq.cache_epoch == self._cache_epoch:
            if len(seq.digests) < full:
                parent = seq.digests[-1] if seq.digests else b""
                seq.digests += block_digests(seq.tokens, bs, full, start=len(seq.digests), parent=parent)
            for i in range(seq.num_registered, full):
                if self.blocks.register(seq.blocks[i], seq.digests[i]):
                    self._step_registered.append(seq.blocks[i])
        seq.num_registered = max(seq.num_registered, full)

    def _forward_and_sample(self, scheduled: list[tuple[_Sequence, int]]) -> tuple[list[float], list[float], dict[str, np.ndarray] | None]:
        """The forward of this step and the sampling of its last rows. One host sync for the results."""
        device = self.device
        seqs = [seq for seq, n in scheduled if seq.num_computed + n == len(seq.tokens)]  # the rows that sample
        want_topk = any(seq.req.return_indexer_topk for seq in seqs)
        self._step_decode_only = not self._forks and all(
            n == 1 and seq.num_computed + 1 == len(seq.tokens) for seq, n in scheduled
        )
        decode_only = self.decoder is not None and self._step_decode_only
        # Time waiting on the device: on CPU the forward itself (it runs on this thread), on CUDA the step's one sync.
        on_host, forward_start = device.type != "cuda", time.perf_counter()
        if decode_only:
            self.stats["paged_decode_steps"] += 1
            hidden, topk_all, write_slots = self.decoder.forward(
                [seq.tokens[-1] for seq in seqs], [seq.num_computed for seq in seqs], [seq.blocks for seq in seqs]
            )
            if self.cache.keep_topk and topk_all is not None:
                self.cache.store_topk(write_slots, topk_all)
        else:
            hidden, topk_all = self._forward_packed(scheduled, want_topk)
        if not seqs:
            self._step_device_s = time.perf_counter() - forward_start if on_host else 0.0
            return [], [], None
        logits = self.model.lm_head(hidden).float()  # (B, V)
        self._step_device_s = time.perf_counter() - forward_start if on_host else 0.0
        self._mask_min_new_tokens(logits, seqs)
        params = SamplingBatch.from_params([seq.req.sampling for seq in seqs], logits.shape[-1], device)
        uniforms = None if params.all_greedy else self._uniforms(seqs).to(device, non_blocking=True)
        tokens, logprobs = sample(logits, params, uniforms)
        topk = None
        if want_topk:
            wanted = [b for b, seq in enumerate(seqs) if seq.req.return_indexer_topk]
            rows = torch.tensor(wanted, device=device) if len(wanted) < len(seqs) else slice(None)
            topk_d = topk_all[:, rows].to(torch.int32).transpose(0, 1)  # (B_wanted, n_full, K) sequence-local
            prompt_d, prompt_seqs = self._read_prompt_topk(seqs)
        sync_start = time.perf_counter()
        result = torch.stack([tokens.double(), logprobs.double()]).tolist()  # the step's one sync
        if not on_host:
            self._step_device_s = time.perf_counter() - sync_start
        if want_topk:
            arrays = list(topk_d.cpu().numpy())  # one (n_full, K) array per requesting row
            topk = {seqs[b].req.rid: arrays[k].copy() for k, b in enumerate(wanted)}  # copies: no view pins the step
            if prompt_seqs:
                split = np.cumsum([n for _, n in prompt_seqs])[:-1]
                for (seq, _), rows_np in zip(prompt_seqs, np.split(prompt_d.transpose(0, 1).cpu().numpy(), split)):
                    seq.prompt_topk = rows_np  # (rows, n_full, K): a view of this step's host copy of prompt rows
        return result[0], result[1], topk

    def _forward_packed(self, scheduled: list[tuple[_Sequence, int]], want_topk: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Any mix of prefill chunks and decode rows in one packed forward, keys gathered from the cache.

        Returns the final hidden states of the rows that sample (B, D) and their top-k (n_full, B, K) or None.
        Forked sequences (self._forks) add no rows: their new cache rows are copied from their twin's after the
        forward, and they sample from their twin's last row.
        """
        bs, device = self.block_size, self.device
        everything, scheduled = scheduled, [(seq, n) for seq, n in scheduled if id(seq) not in self._forks]
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
        last_row_of = {id(seq): int(row_ends[i]) - 1 for i, (seq, n) in enumerate(scheduled)
                       if seq.num_computed + n == len(seq.tokens)}
        # Every sequence that samples this step, in scheduled order, and the query row it samples from.
        sampled = [(i, seq) for i, (seq, n) in enumerate(everything) if seq.num_computed + n == len(seq.tokens)]
        last_rows = np.array([last_row_of[id(self._forks.get(id(seq), seq))] for _, seq in sampled], dtype=np.int64)
        # One host-to-device copy for all step metadata (pinned: a pageable copy would wait for the device).
        packed = torch.from_numpy(np.concatenate([input_ids, starts, lens_q, lens_k, last_rows, table.reshape(-1)]))
        if device.type == "cuda":
            packed = packed.pin_memory()
        packed = packed.to(device, non_blocking=True)
        ids_d, starts_d, lens_q_d, lens_k_d, last_rows_d, table_d = packed.split([Tq, S, S, S, len(last_rows), S * max_blocks])
        table_d = table_d.view(S, max_blocks)
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
        batch = PackedBatch(positions=positions, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, kv_cache=self.cache.bind(write_slots, read_slots))
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

    def _read_prompt_topk(self, seqs: list[_Sequence]) -> tuple[torch.Tensor | None, list[tuple[_Sequence, int]]]:
        """The kept selections of the prompt rows of requests sampling their first token now (n_full, rows, K).

        Read from the cache pool after this step stored its own rows: a reused prefix's rows are there too."""
        bs, slots, picked = self.block_size, [], []
        for seq in seqs:
            if not seq.req.return_indexer_topk or seq.prompt_topk is not None or seq.num_output:
                continue
            first = self._topk_first(seq)
            if first > seq.prompt_len - 2:
                continue
            r = np.arange(first, seq.prompt_len - 1)
            slots.append(np.asarray(seq.blocks, dtype=np.int64)[r // bs] * bs + r % bs)
            picked.append((seq, len(r)))
        if not picked:
            return None, []
        slots_t = torch.from_numpy(np.concatenate(slots))
        if self.device.type == "cuda":
            slots_t = slots_t.pin_memory()  # a pageable upload would make the host wait for the forward here
        return self.cache.read_topk(slots_t.to(self.device, non_blocking=True)), picked

    def _copy_fork_rows(self, scheduled: list[tuple[_Sequence, int]]) -> None:
        """Fill each forked sequence's new cache rows with its twin's (same tokens, same positions, same weights)."""
        bs = self.block_size
        src, dst = [], []
        for seq, n in scheduled:
            twin = self._forks.get(id(seq))
            if twin is None:
                continue
            for pos in range(seq.num_computed, seq.num_computed + n):
                src.append(twin.blocks[pos // bs] * bs + pos % bs)
                dst.append(seq.blocks[pos // bs] * bs + pos % bs)
        if dst:
            self.cache.copy_rows(torch.tensor(src, device=self.device), torch.tensor(dst, device=self.device))

    def _mask_min_new_tokens(self, logits: torch.Tensor, seqs: list[_Sequence]) -> None:
        rows, ids = [], []
        for b, seq in enumerate(seqs):
            if seq.num_output < seq.stop.min_new_tokens:
                masked = seq.stop.masked_ids
                rows += [b] * len(masked)
                ids += masked
        if rows:
            mask_tokens(logits, torch.tensor(rows, device=logits.device), torch.tensor(ids, device=logits.device))

    def _uniforms(self, seqs: list[_Sequence]) -> torch.Tensor:
        """One uniform per row: from the request's own generator when seeded (batch-independent), else the engine's."""
        u = torch.rand(len(seqs), generator=self._rng, dtype=torch.float64)
        for b, seq in enumerate(seqs):
            if seq.generator is not None and not seq.req.sampling.greedy:
                u[b] = torch.rand((), generator=seq.generator, dtype=torch.float64)
        return u

    # -- finishing, retracting, failures --------------------------------------------------------

    def _topk_rows(self, seq: _Sequence) -> tuple[np.ndarray, int]:
        """(selections of rows first .. P+R-2 as (rows, n_full, K) int32, first): what the final output carries."""
        P, R = seq.prompt_len, len(seq.topk)
        first = self._topk_first(seq)
        if seq.prompt_topk is None:  # no token sampled yet, or no prompt row asked for
            first = max(first, P - 1)
        first = min(first, P - 1 + R)
        shape = (0, self.n_full_layers, self.config.index_topk)
        out = np.stack(seq.topk)[first - (P - 1) :] if first - (P - 1) < R else np.zeros(shape, dtype=np.int32)
        if first < P - 1:
            out = np.concatenate([seq.prompt_topk, out])
        return out, first

    def _output(self, seq: _Sequence, final: bool = False) -> GenerateOutput:
        topk = topk_start = None
        if final and seq.req.return_indexer_topk:
            topk, topk_start = self._topk_rows(seq)
        return GenerateOutput(
            rid=seq.req.rid,
            output_ids=seq.output_ids,
            output_token_logprobs=list(seq.logprobs),
            output_token_versions=list(seq.versions),
            finish_reason=seq.finish_reason,
            prompt_tokens=seq.prompt_len,
            cached_tokens=seq.cached_tokens,
            weight_version=self._weight_version,
            indexer_topk=topk,
            indexer_topk_start=topk_start,
            text=seq.stop.final_text(seq.output_ids, seq.finish_reason) if final else None,
        )

    def _free(self, seq: _Sequence) -> None:
        self.blocks.release(seq.blocks)
        self.blocks.unreserve(seq.reserved)
        seq.blocks, seq.reserved, seq.num_computed, seq.num_registered, seq.digests = [], 0, 0, 0, []

    def _finish(self, seq: _Sequence, reason: dict) -> GenerateOutput:
        seq.finish_reason = reason
        self._active.pop(seq.req.rid, None)
        if seq in self._running:
            self._running.remove(seq)
            self._free(seq)
        elif seq in self._queue:
            self._queue.remove(seq)
        try:
            return self._output(seq, final=True)
        except Exception as exc:  # noqa: BLE001 - a tokenizer failure must still deliver the final state
            logger.exception("engine: final output of request %s failed", seq.req.rid)
            seq.finish_reason = {"type": "abort", "message": f"detokenization failed: {type(exc).__name__}: {exc}"}
            return self._output(seq)

    def _fail(self, seq: _Sequence, exc: Exception) -> GenerateOutput:
        """End one request with finish_reason abort and the error; blocks it offered this step are not trusted."""
        for block in seq.blocks:
            if block in self._step_registered:
                self.blocks.forget(block)
        out = self._finish(seq, {"type": "abort", "message": f"engine error: {type(exc).__name__}: {exc}"})
        self._ready.append(out)
        return out

    def _retract(self, seq: _Sequence) -> None:
        """Back to the front of the queue without cache; generated tokens (and the seeded generator) are kept."""
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
