"""FAKE Gluon for CPU: runs a `@gluon.jit` kernel's Python body one program at a time on torch tensors, so that its
indexing, masks, arithmetic and the order of its asynchronous copies, waits and wgmmas are checked where there is no
sm_90 GPU (Gluon has no CPU interpreter; tests/test_gluon_emulated.py uses this).

What it models:
- pointers as flat views of the argument tensors plus an offset tensor (loads and stores out of the tensor's storage,
  and two stores to one address in one call, raise);
- shared memory filled with NaN (or -1 for integers) until written, so a read of a buffer no copy has filled yet shows;
- cp.async copies land either when issued or only when `wait_group` retires their group, and async wgmmas read their
  shared operands either when issued or only at `warpgroup_mma_wait` (`Timing`): a kernel must give the same result
  under every timing, as it must on the GPU, where each can happen anywhere in between;
- an async wgmma's result cannot be used before the wait that returns it (it is not a tensor until then);
- `gl.warp_specialize` partitions as threads running side by side, each with its own copy groups and wgmmas, and
  mbarriers (init, arrive, wait on a phase parity, cp.async.mbarrier.arrive): a wait that never completes is reported
  as a deadlock after DEADLOCK_S seconds; copies a barrier tracks land when its phase completes, at the latest.

What it does not model: layouts, warps (a partition's warps run as one Python thread, so a barrier missing between
them goes unseen), register or shared-memory limits, and the GPU's rounding inside an MMA (here float32 products of
the bf16 operands). A kernel that passes here can still fail on the GPU for those; tools/kernel_resources.py compiles
it for sm_90a, and tests/test_ops_gpu.py is the real check.
"""

from __future__ import annotations

import itertools
import threading
import types
from dataclasses import dataclass
from typing import Any, Callable

import torch

_GLUON_LANGUAGE = "triton.experimental.gluon.language"
DEADLOCK_S = 20.0  # an mbarrier wait this long is a deadlock


@dataclass(frozen=True)
class Timing:
    """When asynchronous work takes effect: "issue" (at once) or "wait" (at the latest moment the kernel allows)."""

    copies_land: str = "wait"
    mma_reads: str = "wait"


ALL_TIMINGS = tuple(Timing(c, m) for c in ("issue", "wait") for m in ("issue", "wait"))


class Val(torch.Tensor):
    """A register tensor: a torch tensor with the `.type.layout` that Gluon code reads off its values."""

    @property
    def type(self):  # noqa: A003 (Gluon's name)
        return types.SimpleNamespace(layout=_Layout())


def _val(x: Any) -> Any:
    return x.as_subclass(Val) if isinstance(x, torch.Tensor) and not isinstance(x, Val) else x


def _raw(x: Any) -> Any:
    return x.as_subclass(torch.Tensor) if isinstance(x, torch.Tensor) else x


class _Layout:
    """Any Gluon layout: ignored here."""

    def __init__(self, *args, **kwargs):
        pass

    def __getattr__(self, name: str) -> "_Layout":
        return _Layout()

    @staticmethod
    def get_default_for(*args, **kwargs) -> "_Layout":
        return _Layout()


class Ptr:
    """A tensor of pointers into one argument tensor: its storage as a flat view and an offset per lane."""

    def __init__(self, flat: torch.Tensor, offs: Any = 0):
        self.flat, self.offs = flat, offs

    @classmethod
    def of(cls, t: torch.Tensor) -> "Ptr":
        extent = t.untyped_storage().nbytes() // t.element_size() - t.storage_offset()
        return cls(torch.as_strided(t, (extent,), (1,), t.storage_offset()))

    def __add__(self, other: Any) -> "Ptr":
        return Ptr(self.flat, _raw(self.offs) + _raw(other))

    __radd__ = __add__

    @property
    def dtype(self):
        return types.SimpleNamespace(element_ty=self.flat.dtype)

    def lanes(self, mask: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """(offsets, mask) broadcast to one shape, the masked-in offsets checked against the storage."""
        offs = torch.as_tensor(_raw(self.offs), dtype=torch.int64)
        m = torch.ones((), dtype=torch.bool) if mask is None else torch.as_tensor(_raw(mask), dtype=torch.bool)
        offs, m = torch.broadcast_tensors(offs, m)
        live = offs[m]
        if live.numel() and (live.min() < 0 or live.max() >= self.flat.numel()):
            raise IndexError(f"access out of the tensor: offsets {live.min().item()}..{live.max().item()} of "
                             f"{self.flat.numel()} elements")
        return offs, m


class Smem:
    """A shared-memory buffer (or a view of one: a stage, a transpose)."""

    def __init__(self, data: torch.Tensor):
        self.data = data

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.data.shape)

    def index(self, i: Any) -> "Smem":
        return Smem(self.data[int(i)])

    def permute(self, dims) -> "Smem":
        return Smem(self.data.permute(*dims))

    def _reinterpret(self, dtype, shape, layout=None) -> "Smem":
        """The same bytes as another dtype and shape (row-major: the emulator has no swizzles)."""
        return Smem(self.data.view(-1).view(dtype).view(list(shape)))

    def store(self, value: Any) -> None:
        self.data.copy_(_raw(value).to(self.data.dtype))

    def load(self, layout: Any = None) -> Val:
        return _val(self.data.clone())


class _Pending:
    """An async wgmma's accumulator: only `warpgroup_mma_wait` (or a later wgmma's acc) may read it."""

    def __init__(self, compute: Callable[[], torch.Tensor], now: bool):
        self._compute, self.value = compute, None
        if now:
            self.resolve()

    def resolve(self) -> torch.Tensor:
        if self.value is None:
            self.value = self._compute()
        return self.value


class _Copy:
    """One cp.async: its values read from global memory, landing in shared memory once."""

    def __init__(self, smem: "Smem", values: torch.Tensor):
        self.smem, self.values, self.landed = smem, values, False

    def land(self) -> None:
        if not self.landed:
            self.smem.data.copy_(self.values.to(self.smem.data.dtype))
            self.landed = True


class _Partition:
    """The asynchronous state one partition (the program's warps, or one warp_specialize partition) owns."""

    def __init__(self, threads: int):
        self.threads = threads
        self.open_copies: list[_Copy] = []
        self.groups: list[list[_Copy]] = []
        self.mmas: list[_Pending] = []

    def check_drained(self, pid: tuple[int, ...]) -> None:
        if any(not c.landed for c in self.open_copies + [c for g in self.groups for c in g]):
            raise RuntimeError(f"program {pid} ended with cp.async copies not waited for")
        if any(m.value is None for m in self.mmas):
            raise RuntimeError(f"program {pid} ended with a wgmma not waited for")


class _MBarrier:
    """An mbarrier: arrivals pending in its current phase, the phase bit, and the cp.async copies it tracks."""

    def __init__(self, count: int):
        self.count, self.pending, self.phase = count, count, 0
        self.tracked: list[_Copy] = []


class _Program:
    """The state of the program being run: its ids, timing, partitions and mbarriers."""

    def __init__(self, pid: tuple[int, ...], timing: Timing, threads: int):
        self.pid, self.timing = pid, timing
        self.partitions = {threading.get_ident(): _Partition(threads)}
        self.barriers: dict[int, _MBarrier] = {}
        self.changed = threading.Condition()
        self.failed = False

    def partition(self) -> _Partition:
        return self.partitions[threading.get_ident()]

    def barrier(self, smem: "Smem") -> _MBarrier:
        key = smem.data.data_ptr()
        if key not in self.barriers:
            raise RuntimeError(f"program {self.pid}: an mbarrier used before mbarrier.init")
        return self.barriers[key]

    def finish(self) -> None:
        for partition in self.partitions.values():
            partition.check_drained(self.pid)


_program: _Program | None = None


def _operand(x: Any) -> torch.Tensor:
    return (x.data if isinstance(x, Smem) else _raw(x)).float()


# ---- gl: the language's functions on torch tensors ---------------------------------------------------------------

def _arange(start, end, layout=None) -> Val:
    return _val(torch.arange(int(start), int(end), dtype=torch.int32))


def _zeros(shape, dtype, layout=None) -> Val:
    return _val(torch.zeros(list(shape), dtype=dtype))


def _full(shape, value, dtype, layout=None) -> Val:
    return _val(torch.full(list(shape), value, dtype=dtype))


def _tensor_like(x: Any, like: Any) -> torch.Tensor:
    return _raw(x) if isinstance(x, torch.Tensor) else torch.tensor(x, dtype=_raw(like).dtype)


def _maximum(a, b) -> Val:
    return _val(torch.maximum(_tensor_like(a, b), _tensor_like(b, a)))


def _where(cond, a, b) -> Val:
    return _val(torch.where(_raw(cond), _raw(a), _raw(b)))


def _load(pointer: Ptr, mask=None, other=None, **kwargs) -> Val:
    offs, m = pointer.lanes(mask)
    values = pointer.flat[torch.where(m, offs, 0)] if pointer.flat.numel() else torch.zeros(offs.shape,
                                                                                           dtype=pointer.flat.dtype)
    if not bool(m.all()):
        fill = torch.as_tensor(0 if other is None else _raw(other), dtype=values.dtype)
        values = torch.where(m, values, fill)
    return _val(values)


def _store(pointer: Ptr, value, mask=None, **kwargs) -> None:
    offs, m = pointer.lanes(mask)
    live = offs[m]
    if live.unique().numel() != live.numel():
        raise RuntimeError("two lanes of one store write the same address")
    value = torch.broadcast_to(torch.as_tensor(_raw(value)), offs.shape)
    pointer.flat[live] = value[m].to(pointer.flat.dtype)


def _atomic_add(pointer: Ptr, value, mask=None, sem=None, scope=None) -> None:
    offs, m = pointer.lanes(mask)
    value = torch.broadcast_to(torch.as_tensor(_raw(value)), offs.shape)
    pointer.flat.index_put_((offs[m],), value[m].to(pointer.flat.dtype), accumulate=True)


def _allocate_shared_memory(dtype, shape, layout=None, value=None) -> Smem:
    fill = float("nan") if dtype.is_floating_point else -1
    smem = Smem(torch.full(list(shape), fill, dtype=dtype))
    if value is not None:
        smem.store(value)
    return smem


def _cdiv(a, b):
    a, b = (int(x) if isinstance(x, torch.Tensor) else x for x in (a, b))
    return -(-a // b)


def _program_id(axis) -> Val:
    return _val(torch.tensor(_program.pid[int(axis)], dtype=torch.int32))


def _reduce(op):
    return lambda x, axis=None, **kwargs: _val(op(_raw(x)) if axis is None else op(_raw(x), dim=int(axis)))


def _unary(op):
    return lambda x, **kwargs: _val(op(_raw(x)))


def _split(x) -> tuple[Val, Val]:
    return _val(_raw(x)[..., 0]), _val(_raw(x)[..., 1])


def _no_op(*args, **kwargs) -> None:
    return None


class _Constexpr:
    def __init__(self, value=None):
        self.value = value


def _static_assert(condition, message: str = "") -> None:
    if not condition:
        raise AssertionError(f"gl.static_assert failed: {message}")


class _Language(types.SimpleNamespace):
    """The emulated `gl` module: every `...Layout` class is the ignored layout."""

    def __getattr__(self, name: str):
        if name.endswith("Layout"):
            return _Layout
        raise AttributeError(f"the Gluon emulator has no gl.{name}")


gl = _Language(
    constexpr=_Constexpr, float32=torch.float32, float16=torch.float16, bfloat16=torch.bfloat16,
    int32=torch.int32, int64=torch.int64, int8=torch.int8, float8e4nv=torch.float8_e4m3fn,
    arange=_arange, zeros=_zeros, full=_full, load=_load, store=_store, atomic_add=_atomic_add,
    where=_where, maximum=_maximum, minimum=lambda a, b: _val(torch.minimum(_tensor_like(a, b), _tensor_like(b, a))),
    max=_reduce(torch.amax), min=_reduce(torch.amin), sum=_reduce(torch.sum),
    exp=_unary(torch.exp), exp2=_unary(torch.exp2), log=_unary(torch.log), log2=_unary(torch.log2),
    convert_layout=lambda x, layout, **kwargs: x, static_range=range, cdiv=_cdiv, program_id=_program_id,
    allocate_shared_memory=_allocate_shared_memory, thread_barrier=_no_op, barrier=_no_op,
    static_assert=_static_assert, split=_split,
    reshape=lambda x, shape, **kwargs: _val(_raw(x).reshape(list(shape))),
    permute=lambda x, dims: _val(_raw(x).permute(*dims)),
)


# ---- cp.async and wgmma ------------------------------------------------------------------------------------------

def _async_copy_global_to_shared(smem: Smem, pointer: Ptr, mask=None, **kwargs) -> None:
    copy = _Copy(smem, _raw(_load(pointer, mask)))  # global memory does not change under the kernel: read it now
    if _program.timing.copies_land == "issue":
        copy.land()
    else:
        _program.partition().open_copies.append(copy)


def _commit_group() -> None:
    partition = _program.partition()
    partition.groups.append(partition.open_copies)
    partition.open_copies = []


def _wait_group(num_outstanding=0) -> None:
    partition = _program.partition()
    while len(partition.groups) > int(num_outstanding):
        for copy in partition.groups.pop(0):
            copy.land()


def _arrive(bar: _MBarrier, count: int) -> None:
    with _program.changed:
        bar.pending -= count
        if bar.pending < 0:
            raise RuntimeError(f"program {_program.pid}: more arrivals on an mbarrier than its count")
        if bar.pending == 0:
            for copy in bar.tracked:
                copy.land()
            bar.tracked, bar.pending, bar.phase = [], bar.count, bar.phase ^ 1
            _program.changed.notify_all()


def _copies_mbarrier_arrive(mbarrier: Smem, increment_count=True) -> None:
    """cp.async.mbarrier.arrive by each thread of the partition: the barrier tracks the partition's copies so far
    (they land when its phase completes, at the latest); without increment_count each thread's arrival counts."""
    bar, partition = _program.barrier(mbarrier), _program.partition()
    with _program.changed:
        bar.tracked += [c for c in partition.open_copies + [c for g in partition.groups for c in g] if not c.landed]
    if not increment_count:
        _arrive(bar, partition.threads)


cp = types.SimpleNamespace(async_copy_global_to_shared=_async_copy_global_to_shared, commit_group=_commit_group,
                           wait_group=_wait_group, mbarrier_arrive=_copies_mbarrier_arrive)


def _mbarrier_init(mbarrier: Smem, count) -> None:
    _program.barriers[mbarrier.data.data_ptr()] = _MBarrier(int(count))


def _mbarrier_arrive(mbarrier: Smem, *, count=1, pred=True) -> None:
    """One arrival of `count` for the partition (Gluon lowers it to a single elected thread)."""
    if bool(pred):
        _arrive(_program.barrier(mbarrier), int(count))


def _mbarrier_wait(mbarrier: Smem, phase, pred=True, deps=()) -> None:
    """Blocks until the barrier's phase of parity `phase` has completed (its phase bit differs from `phase`)."""
    if not bool(pred):
        return
    bar, parity = _program.barrier(mbarrier), int(phase)
    with _program.changed:
        if not _program.changed.wait_for(lambda: bar.phase != parity or _program.failed, timeout=DEADLOCK_S):
            _program.failed = True
            _program.changed.notify_all()
            raise RuntimeError(f"program {_program.pid}: deadlock, an mbarrier wait on parity {parity} never "
                               f"completed ({bar.pending} of {bar.count} arrivals missing)")
        if _program.failed:
            raise RuntimeError(f"program {_program.pid}: another partition failed")


def _mbarrier_invalidate(mbarrier: Smem) -> None:
    _program.barriers.pop(mbarrier.data.data_ptr(), None)


mbarrier = types.SimpleNamespace(init=_mbarrier_init, arrive=_mbarrier_arrive, wait=_mbarrier_wait,
                                 invalidate=_mbarrier_invalidate, MBarrierLayout=_Layout)


def _warp_specialize(functions_and_args, worker_num_warps, worker_num_regs=None, **kwargs):
    """Runs each worker partition in a thread of its own beside the default one (this thread), as the GPU runs them
    side by side; returns the default partition's result."""
    program, errors = _program, []

    def run_worker(fn, args, warps: int) -> None:
        program.partitions[threading.get_ident()] = _Partition(warps * 32)
        try:
            with torch.no_grad():
                fn(*args)
        except BaseException as err:  # noqa: BLE001 (re-raised in the launching thread)
            errors.append(err)
            with program.changed:
                program.failed = True
                program.changed.notify_all()

    workers = [threading.Thread(target=run_worker, args=(fn, args, int(warps)), daemon=True)
               for (fn, args), warps in zip(functions_and_args[1:], worker_num_warps)]
    for worker in workers:
        worker.start()
    default_fn, default_args = functions_and_args[0]
    try:
        result = default_fn(*default_args)
    except BaseException:
        with program.changed:
            program.failed = True
            program.changed.notify_all()
        raise
    finally:
        for worker in workers:
            worker.join(DEADLOCK_S)
    if errors:
        raise errors[0]
    return result


def _warpgroup_mma(a, b, acc, *, use_acc=True, is_async=False, **kwargs):
    def compute() -> torch.Tensor:
        product = _operand(a) @ _operand(b)
        if not use_acc:
            return product
        return product + (acc.resolve() if isinstance(acc, _Pending) else _raw(acc)).float()

    if not is_async:
        return _val(compute())
    pending = _Pending(compute, now=_program.timing.mma_reads == "issue")
    _program.partition().mmas.append(pending)
    return pending


def _warpgroup_mma_wait(num_outstanding=0, deps=None):
    # Each async warpgroup_mma is one commit group; the hardware retires a warp group's groups in issue order, so
    # all but the newest num_outstanding complete here.
    partition = _program.partition()
    keep = int(num_outstanding)
    retiring = partition.mmas[:max(0, len(partition.mmas) - keep)]
    for pending in retiring:
        pending.resolve()
    partition.mmas = partition.mmas[len(retiring):]
    for d in deps:
        if isinstance(d, _Pending) and d.value is None:
            raise RuntimeError("warpgroup_mma_wait: a dependency is still outstanding after the wait")
    out = tuple(_val(d.value) if isinstance(d, _Pending) else d for d in deps)
    return out[0] if len(out) == 1 else out


gl.warp_specialize = _warp_specialize
_FUNCTIONS = {"warpgroup_mma": _warpgroup_mma, "warpgroup_mma_wait": _warpgroup_mma_wait,
              "warpgroup_mma_init": lambda value: value,
              "fence_async_shared": _no_op, "thread_barrier": _no_op, "barrier": _no_op,
              "warp_specialize": _warp_specialize}


# ---- running a kernel --------------------------------------------------------------------------------------------

_emulated_cache: dict[int, Callable] = {}


def _substitute(value: Any) -> Any:
    from triton.runtime.jit import JITFunction

    if isinstance(value, JITFunction):
        return lambda *args, **kwargs: emulated(value)(*args, **kwargs)
    if isinstance(value, types.ModuleType):
        if value.__name__ == _GLUON_LANGUAGE:
            return gl
        if value.__name__.endswith("async_copy"):
            return cp
        if value.__name__.endswith("mbarrier"):
            return mbarrier
        return value
    module = getattr(value, "__module__", None) or ""
    if module.startswith(_GLUON_LANGUAGE) and callable(value):
        name = getattr(value, "__name__", "")
        if name not in _FUNCTIONS:
            raise NotImplementedError(f"the Gluon emulator has no {module}.{name}")
        return _FUNCTIONS[name]
    return value


def emulated(jit_fn) -> Callable:
    """The Python function of a `@gluon.jit` function with Gluon's names bound to the emulator's."""
    if id(jit_fn) not in _emulated_cache:
        fn = jit_fn.fn
        names = {name: _substitute(value) for name, value in fn.__globals__.items() if name in fn.__code__.co_names}
        _emulated_cache[id(jit_fn)] = types.FunctionType(fn.__code__, {**fn.__globals__, **names}, fn.__name__,
                                                         fn.__defaults__, fn.__closure__)
    return _emulated_cache[id(jit_fn)]


class EmulatedKernel:
    """Stands in for a Gluon kernel at its launch, `kernel[grid](*args, **constexprs)`: runs every program of the grid
    under `timing`; `overrides` replace constexprs the host code passes (e.g. to take the 64-bit row path)."""

    def __init__(self, jit_fn, timing: Timing = Timing(), overrides: dict | None = None):
        self.fn, self.timing, self.overrides = emulated(jit_fn), timing, overrides or {}
        self.launches = 0

    def __getitem__(self, grid):
        grid = tuple(grid) if isinstance(grid, (tuple, list)) else (grid,)

        def launch(*args, **constexprs):
            global _program
            args = [Ptr.of(a) if isinstance(a, torch.Tensor) else a for a in args]
            constexprs = {**constexprs, **self.overrides}
            self.launches += 1
            threads = torch.get_num_threads()
            torch.set_num_threads(1)  # many tiny ops: extra threads only contend with the machine's other work
            try:
                for pid in itertools.product(*(range(int(g)) for g in grid)):
                    _program = _Program(pid + (0,) * (3 - len(pid)), self.timing, 32 * constexprs.get("num_warps", 4))
                    with torch.no_grad():
                        self.fn(*args, **constexprs)
                    _program.finish()
            finally:
                _program = None
                torch.set_num_threads(threads)

        return launch


__all__ = ["ALL_TIMINGS", "EmulatedKernel", "Timing", "emulated"]
