"""asyncio front of the engine: the step loop runs in one background thread, callers await on the event loop.

Thread model: every call that touches the model or the engine's state is a command executed on the engine
thread between two steps; results and streamed outputs come back to the event loop through
`loop.call_soon_threadsafe` (one call per step for all outputs). The HTTP server is written against this API.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from rollout.engine.engine import Engine
from rollout.engine.types import GenerateOutput, GenerateRequest, RequestError
from slime_dsa.gc_watch import GcWatch
from slime_dsa.trace_recorder import annotate

if TYPE_CHECKING:
    from slime_dsa.weights.cuda_ipc import IpcBuffer, IpcTensor, IpcWeights

logger = logging.getLogger(__name__)


# A step's fixed cost outside CUDA graphs (an eager prefill forward, ~1k kernel launches) is tens of ms on a GPU host,
# far more than the ~1 ms between a burst's consecutive calls.
DEFAULT_GATHER_MS = 3.0
GATHER_ROUNDS = 40


class EngineStoppedError(RuntimeError):
    """The engine thread is not running (not started yet, or stopped)."""


class AsyncEngine:
    """Runs `engine.step()` in a background thread and exposes it to asyncio.

    gather_ms: when an idle engine gets work, it keeps taking commands that arrive within gather_ms of the previous
    one (for at most GATHER_ROUNDS x gather_ms) before its first step, so a burst of calls (an RL step's groups) is
    prefilled in one step rather than spread over several; 0 steps at once. Running requests never wait for it.
    """

    def __init__(self, engine: Engine, *, model_path: str | None = None, tokenizer_path: str | None = None,
                 gather_ms: float = DEFAULT_GATHER_MS, collect_when_paused: bool = True) -> None:
        if gather_ms < 0:
            raise ValueError(f"gather_ms must be >= 0, got {gather_ms}")
        self.engine = engine
        self.gather_s = gather_ms / 1e3
        self.gc_watch = GcWatch(engine.stats)
        self.collect_when_paused = collect_when_paused
        self.model_path, self.tokenizer_path = model_path, tokenizer_path
        self._commands: queue.SimpleQueue[tuple[Callable[[], Any], asyncio.Future | None]] = queue.SimpleQueue()
        self._streams: dict[str, asyncio.Queue[GenerateOutput] | _Finals] = {}  # rid -> where its outputs go
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping = False
        self._preloaded: dict[str, dict[str, torch.Tensor]] = {}  # checkpoint dir -> its weights in host memory
        self._ipc: _OpenIpc | None = None  # the last cuda_ipc buffer, kept mapped while its sender keeps the handle
        self.ipc_opens = 0  # cuda_ipc buffers mapped so far

    # -- lifecycle ------------------------------------------------------------------------------

    async def start(self) -> None:
        """Start the engine thread (idempotent)."""
        if self._thread is not None and self._thread.is_alive():
            return
        self._loop = asyncio.get_running_loop()
        self._stopping = False
        self.gc_watch.install()
        self._thread = threading.Thread(target=self._run, name="slime-dsa-engine", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        """Abort every request, then end the engine thread."""
        if self._thread is None:
            return
        try:
            await self.abort(abort_all=True)
        except EngineStoppedError:
            pass
        self._stopping = True
        self._commands.put((lambda: None, None))  # wake the thread
        thread, self._thread = self._thread, None
        await asyncio.to_thread(thread.join)
        self._ipc = None  # unmaps the sender's buffer
        self.gc_watch.uninstall()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    # -- generation -----------------------------------------------------------------------------

    async def generate(self, req: GenerateRequest) -> AsyncIterator[GenerateOutput]:
        """Yield cumulative outputs as tokens arrive; the last has finish_reason set. Raises RequestError.

        Closing or cancelling the consumer aborts the request.
        """
        if req.rid in self._streams:
            raise RequestError(f"rid {req.rid!r} is already in use")
        stream: asyncio.Queue[GenerateOutput] = asyncio.Queue()
        self._streams[req.rid] = stream
        finished = False
        try:
            try:
                await self._call(lambda: self.engine.add_request(req))
            except RequestError:
                finished = True  # rejected: nothing to abort
                raise
            while True:
                out = await stream.get()
                while not stream.empty():  # outputs are cumulative: only the newest matters
                    out = stream.get_nowait()
                finished = out.finish_reason is not None
                yield out
                if finished:
                    return
        finally:
            self._streams.pop(req.rid, None)
            if not finished and self.running:
                try:
                    self._submit(lambda: self._dispatch(self.engine.abort(req.rid, message="client disconnected")))
                except EngineStoppedError:
                    pass  # stopping: every request is being aborted anyway

    async def finals(self, reqs: list[GenerateRequest]) -> list[GenerateOutput]:
        """The requests' final outputs, in order: all added in one engine command and collected by one future (none
        streams). A refused request raises its RequestError, and none of them runs; cancelling aborts those left."""
        if not reqs:
            return []
        rids = [req.rid for req in reqs]
        if taken := next((rid for rid in rids if rid in self._streams), None) or _repeated(rids):
            raise RequestError(f"rid {taken!r} is already in use")
        for req in reqs:
            req.stream = False  # only the final state is used: the engine skips the per-step copies
        finals = _Finals(rids, asyncio.get_running_loop().create_future())
        for rid in rids:
            self._streams[rid] = finals
        refused = False
        try:
            try:
                await self._call(lambda: self.engine.add_requests(reqs))
            except RequestError:
                refused = True  # nothing to abort
                raise
            return await finals.future
        finally:
            for rid in rids:
                self._streams.pop(rid, None)
            if not refused and finals.left and self.running:  # cancelled (also while being added)
                left = [rid for rid, out in zip(rids, finals.outputs) if out is None]
                try:
                    self._submit(lambda: self._dispatch(self._abort_each(left, "client disconnected")))
                except EngineStoppedError:
                    pass  # stopping: every request is being aborted anyway

    def _abort_each(self, rids: list[str], message: str) -> list[GenerateOutput]:
        """Engine thread: abort these requests; their final outputs."""
        return [out for rid in rids for out in self.engine.abort(rid, message=message)]

    async def abort(self, rid: str | None = None, abort_all: bool = False) -> None:
        """Abort one request (or all); their streams end with finish_reason abort."""
        await self._call(lambda: self._dispatch(self.engine.abort(rid, abort_all)))

    async def pause(self, mode: str = "abort") -> None:
        """Pause generation: mode abort | retract | in_place (SGLang's pause_generation). With collect_when_paused,
        a full garbage collection follows on the engine thread once the caller has its answer (gc_watch.py)."""
        await self._call(lambda: self._dispatch(self.engine.pause(mode)))
        if self.collect_when_paused:
            self._submit(self.gc_watch.collect_paused)

    async def resume(self) -> None:
        await self._call(self.engine.resume)

    # -- weights and cache ----------------------------------------------------------------------

    async def update_weights(self, state_dict: dict[str, torch.Tensor], weight_version: str | None = None,
                             flush_cache: bool = True, pause_mode: str | None = None) -> None:
        """Update the model in place between two steps. Raises RequestError naming a bad tensor.

        pause_mode: pause in that mode first and continue after (also when the update fails), all in the same
        command, so no step runs in between: one call instead of pause, update and continue.
        """
        await self._call(self._paused(
            lambda: self.engine.update_weights(state_dict, weight_version, flush_cache=flush_cache), pause_mode))

    async def update_weights_from_cuda_ipc(self, ipc: IpcWeights, weight_version: str | None = None,
                                           flush_cache: bool = True, pause_mode: str | None = None) -> None:
        """Copy the tensors of a sender's CUDA buffer (same GPU, another process) into the model, device to device.

        Names and shapes are checked before the handle is opened; RequestError names a bad tensor or the device.
        pause_mode: as for update_weights.
        """
        await self._call(self._paused(lambda: self._load_cuda_ipc(ipc, weight_version, flush_cache), pause_mode))

    def _paused(self, update: Callable[[], None], pause_mode: str | None) -> Callable[[], None]:
        """`update`, or with a pause_mode: pause → update → continue, run as one command on the engine thread."""
        if pause_mode is None:
            return update

        def paused_update() -> None:
            self._dispatch(self.engine.pause(pause_mode))
            try:
                update()
            finally:
                self.engine.resume()
        return paused_update

    def _load_cuda_ipc(self, ipc: IpcWeights, weight_version: str | None, flush_cache: bool) -> None:
        from slime_dsa.weights.cuda_ipc import IpcFormatError  # noqa: PLC0415

        engine = self.engine
        try:
            ipc.check_against({name: tuple(t.shape) for name, t in engine.parameters_by_name().items()})
            opened = self._open_ipc(ipc)
        except IpcFormatError as e:
            raise RequestError(str(e)) from None
        engine.update_weights(opened.views, weight_version, flush_cache=flush_cache, finite_spans=opened.spans)
        if engine.device.type == "cuda":  # the copies read the sender's memory: done before the sender refills it
            torch.cuda.current_stream(engine.device).synchronize()

    def _open_ipc(self, ipc: IpcWeights) -> _OpenIpc:
        """The buffer of `ipc` mapped, with a view per tensor. A sender exports one buffer and refills it for every
        version (trainers/shared_weights.py), so the mapping and the views of the last update are kept and reused
        while the buffer's handle is the same; a new handle unmaps the old buffer."""
        from slime_dsa.weights.cuda_ipc import float_spans, open_buffer, views  # noqa: PLC0415

        opened = self._ipc
        if opened is None or opened.buffer != ipc.buffer:
            self._ipc = None  # the old buffer first: torch unmaps it once no storage uses it
            self._ipc = opened = _OpenIpc(ipc.buffer, open_buffer(ipc.buffer, self.engine.device))
            self.ipc_opens += 1
        if opened.tensors != ipc.tensors:
            opened.views, opened.tensors = views(opened.flat, ipc.tensors), ipc.tensors
            opened.spans = float_spans(opened.flat, ipc.tensors)
        return opened

    async def update_weights_from_disk(self, path: str | Path, weight_version: str | None = None,
                                       pause_mode: str | None = None) -> None:
        """Load safetensors from an HF-format directory (read off the engine thread, while generation goes on), then
        update in place; a preloaded directory is copied from host memory instead. pause_mode: as for update_weights."""
        from slime_dsa.checkpoint import read_state_dict  # noqa: PLC0415 (only needed here)
        from slime_dsa.checkpoint.validate import safetensors_problem  # noqa: PLC0415

        def read() -> dict[str, torch.Tensor]:
            for file in sorted(Path(path).glob("*.safetensors")):  # a truncated or corrupt file: named, nothing read
                if problem := safetensors_problem(file):
                    raise RequestError(f"update_weights_from_disk: {file} {problem}")
            return read_state_dict(path)

        state = self._preloaded.get(_key(path))
        if state is None:
            try:
                state = await asyncio.to_thread(read)
            except (FileNotFoundError, OSError) as exc:
                raise RequestError(f"update_weights_from_disk: model_path {str(path)!r}: {exc}") from exc
        await self.update_weights(state, weight_version, pause_mode=pause_mode)
        self.model_path = str(path)

    def preload_weights(self, paths: list[str | Path]) -> None:
        """Read checkpoints into host memory now, in the model's dtypes, pinned when the engine is on a GPU (a copy
        in then runs at full PCIe speed): update_weights_from_disk of one of them reads no disk. For teachers that
        take turns on one engine (rollout/teachers/swap.py)."""
        from slime_dsa.checkpoint import read_state_dict  # noqa: PLC0415

        params = self.engine.model.state_dict()
        pin = self.engine.device.type == "cuda"
        for path in paths:
            state = {}
            for name, tensor in read_state_dict(path).items():
                target = params.get(name)
                tensor = tensor.to(target.dtype) if target is not None else tensor
                state[name] = tensor.pin_memory() if pin else tensor.contiguous()
            self._preloaded[_key(path)] = state
            logger.info("preloaded %s (%.1f MiB%s)", path, sum(t.nbytes for t in state.values()) / 2**20,
                        ", pinned" if pin else "")

    async def flush_cache(self) -> bool:
        return await self._call(self.engine.flush_cache)

    async def release_memory(self, tags: list[str] | None = None) -> None:
        await self._call(lambda: self.engine.release_memory(tags))

    async def resume_memory(self, tags: list[str] | None = None) -> None:
        await self._call(lambda: self.engine.resume_memory(tags))

    # -- information ----------------------------------------------------------------------------

    @property
    def weight_version(self) -> str:
        return self.engine.weight_version

    @property
    def num_running(self) -> int:
        return self.engine.num_running

    @property
    def num_queued(self) -> int:
        return self.engine.num_queued

    def model_info(self) -> dict:
        config = self.engine.config
        return {
            "model_path": self.model_path,
            "tokenizer_path": self.tokenizer_path,
            "is_generation": True,
            "weight_version": self.engine.weight_version,
            "model_type": "glm_moe_dsa",
            "vocab_size": config.vocab_size,
            "max_context_length": config.max_position_embeddings,
            "index_topk": config.index_topk,
            "n_full_layers": self.engine.n_full_layers,
        }

    def server_info(self) -> dict:
        engine = self.engine
        from slime_dsa import __version__  # noqa: PLC0415

        return {
            "engine": "embedded",
            "version": __version__,
            "model_path": self.model_path,
            "device": str(engine.device),
            "dtype": str(engine.model.dtype).removeprefix("torch."),
            "max_cache_tokens": engine.max_cache_tokens,
            "kv_cache_bytes": engine.cache.pool_nbytes,
            "index_key_cache_dtype": str(engine.cache.index_key_dtype).removeprefix("torch."),
            "device_memory_bytes": _device_memory(engine.device),
            "max_running_requests": engine.max_running_requests,
            "max_prefill_tokens": engine.max_prefill_tokens,
            "block_size": engine.block_size,
            "num_continuous_decode_steps": engine.num_continuous_decode_steps,
            "enable_torch_compile": engine.enable_torch_compile,
            "enable_prefix_caching": engine.blocks.enable_prefix_caching,
            "num_running": engine.num_running,
            "num_queued": engine.num_queued,
            "paused": engine.paused,
            "weight_version": engine.weight_version,
            **self.step_stats(),
        }

    def step_stats(self) -> dict:
        """The step loop's counters as /get_server_info gives them (stats_*, with max_running_requests): what
        slime_dsa.orchestrator.perf reads, also sent in a weight update's reply."""
        engine = self.engine
        return {"max_running_requests": engine.max_running_requests,
                **{f"stats_{k}": v for k, v in engine.stats.items()}}

    # -- the engine thread --------------------------------------------------------------------

    def _run(self) -> None:
        stats = self.engine.stats
        stats.setdefault("commands", 0)
        stats.setdefault("command_s", 0.0)
        stats.setdefault("gather_s", 0.0)
        while not self._stopping:
            idle = not self.engine.has_work
            self._take_commands(block=idle)
            if self._stopping or not self.engine.has_work:
                continue
            if idle and self.gather_s > 0:
                start = time.perf_counter()
                with annotate("engine.gather"):
                    self._take_commands(block=True, gap_s=self.gather_s)
                stats["gather_s"] += time.perf_counter() - start
            try:
                with annotate("engine.step"):
                    outputs = self.engine.step()
                self._dispatch(outputs)
            except Exception as exc:  # noqa: BLE001 - a scheduler bug: end the requests, keep serving
                logger.exception("engine: step failed outside a forward; aborting all requests")
                try:
                    self._dispatch(self.engine.abort(abort_all=True, message=f"engine error: {type(exc).__name__}: {exc}"))
                except Exception:  # noqa: BLE001
                    logger.exception("engine: abort after a failed step failed too")
        # Fail whatever was submitted after stop.
        while True:
            try:
                fn, future = self._commands.get_nowait()
            except queue.Empty:
                break
            if future is not None:
                self._loop.call_soon_threadsafe(_set_exception, future, EngineStoppedError("engine stopped"))

    def _take_commands(self, block: bool, gap_s: float | None = None) -> None:
        """Run queued commands: wait for the first if `block`; with `gap_s`, also wait up to gap_s for each next one
        (for at most GATHER_ROUNDS x gap_s in all)."""
        stats = self.engine.stats
        deadline = time.perf_counter() + GATHER_ROUNDS * gap_s if gap_s is not None else None
        try:
            while not self._stopping:
                if deadline is None:
                    fn, future = self._commands.get(block=block)
                else:
                    left = deadline - time.perf_counter()
                    if left <= 0:
                        return
                    fn, future = self._commands.get(timeout=min(gap_s, left))
                start = time.perf_counter()
                hand_over = self._execute(fn, future)
                # Counted before the caller sees the result: a reply that carries the counters (a weight
                # update's) then includes its own command, as a later /get_server_info would.
                stats["commands"] += 1
                stats["command_s"] += time.perf_counter() - start
                hand_over()
                block = False
        except queue.Empty:
            pass

    def _execute(self, fn: Callable[[], Any], future: asyncio.Future | None) -> Callable[[], None]:
        """Run a command; returns what hands its result (or error) to the awaiting coroutine."""
        try:
            result = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting coroutine
            if future is None:
                logger.exception("engine: background command failed")
                return _nothing
            return functools.partial(self._loop.call_soon_threadsafe, _set_exception, future, exc)
        if future is None:
            return _nothing
        return functools.partial(self._loop.call_soon_threadsafe, _set_result, future, result)

    def _dispatch(self, outputs: list[GenerateOutput]) -> None:
        """Engine thread: hand a step's outputs to their streams on the event loop, in one callback."""
        if outputs:
            self._loop.call_soon_threadsafe(self._deliver, outputs)

    def _deliver(self, outputs: list[GenerateOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.rid)
            if stream is not None:
                stream.put_nowait(out)

    def _submit(self, fn: Callable[[], Any], future: asyncio.Future | None = None) -> None:
        if not self.running:
            raise EngineStoppedError("the engine is not running: call start() first")
        self._commands.put((fn, future))

    async def on_engine_thread(self, fn: Callable[[], Any]) -> Any:
        """Run fn on the engine thread between two steps (a profiler's start and stop: it records that thread's ops)."""
        return await self._call(fn)

    async def _call(self, fn: Callable[[], Any]) -> Any:
        """Run fn on the engine thread between two steps and return its result."""
        future = asyncio.get_running_loop().create_future()
        self._submit(fn, future)
        return await future


@dataclass
class _OpenIpc:
    """A sender's cuda_ipc buffer mapped into this process (`flat`), and the views of the last table read from it."""

    buffer: IpcBuffer
    flat: torch.Tensor
    tensors: tuple[IpcTensor, ...] = ()
    views: dict[str, torch.Tensor] = field(default_factory=dict)
    spans: list[torch.Tensor] = field(default_factory=list)  # float_spans of the table: the finiteness check's


class _Finals:
    """Collects the final outputs of one call's requests for `AsyncEngine.finals`; stands in for their streams."""

    def __init__(self, rids: list[str], future: asyncio.Future) -> None:
        self.index = {rid: i for i, rid in enumerate(rids)}
        self.outputs: list[GenerateOutput | None] = [None] * len(rids)
        self.left, self.future = len(rids), future

    def put_nowait(self, out: GenerateOutput) -> None:
        """Event loop: keep a final output; the future resolves with all of them once the last is in."""
        i = self.index[out.rid]
        if out.finish_reason is None or self.outputs[i] is not None:
            return
        self.outputs[i] = out
        self.left -= 1
        if not self.left and not self.future.done():
            self.future.set_result(self.outputs)


def _repeated(rids: list[str]) -> str | None:
    """A rid that appears twice in `rids`, if any."""
    seen: set[str] = set()
    for rid in rids:
        if rid in seen:
            return rid
        seen.add(rid)
    return None


def _device_memory(device: torch.device) -> int | None:
    """The GPU's total memory in bytes; None on CPU."""
    return torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None


def _key(path: str | Path) -> str:
    return str(Path(path).expanduser().resolve())


def _nothing() -> None:
    pass


def _set_result(future: asyncio.Future, result: Any) -> None:
    if not future.done():
        future.set_result(result)


def _set_exception(future: asyncio.Future, exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)
