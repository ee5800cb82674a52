"""Capture backends: real CUDA graphs, and an emulation of their memory semantics on the CPU.

Both expose the same three operations to the runtime: make a memory pool, capture a callable into a graph (which
returns the graph and the output tensors, whose storage the graph writes on every replay), and replay. Neither
executes the callable's side effects at capture time: a CUDA capture only records, and the emulation undoes what
its capture run did.
"""

from __future__ import annotations

import contextlib
import gc
import threading
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import torch

from cudagraphex._protections import PROTECTIONS

__all__ = [
    "CaptureFailed",
    "CudaBackend",
    "EmulatedBackend",
    "SharedPool",
    "allocate_blas_workspaces",
    "backend_for",
    "is_capturing",
    "whole_step",
]

#: Captures are serialised process-wide: two threads capturing at once would share the capture stream.
_capture_lock = threading.Lock()
_capturing = threading.local()
_capture_streams: dict[int, torch.cuda.Stream] = {}


class CaptureFailed(RuntimeError):
    """Capturing a region failed; the process is left as it was before the attempt."""


class SharedPool:
    """The id of the memory pool that a set of graphs share, renewed while no graph captured into it is alive.

    The caching allocator keeps a pool after its last graph is gone, until the pool's memory is freed, and a capture
    into such a pool fails an internal assert (``use_count > 0``). A pool whose only captures failed or were discarded
    is one; the next capture then gets a new pool.
    """

    def __init__(self, new_id: Callable[[], Any]) -> None:
        self._new_id = new_id
        self._id: Any = None
        self._graphs: weakref.WeakSet = weakref.WeakSet()

    def for_capture(self) -> Any:
        """The id to capture into."""
        if self._id is None or not self._graphs:
            self._id, self._graphs = self._new_id(), weakref.WeakSet()
        return self._id

    def captured(self, graph: Any, pool_id: Any) -> None:
        """Notes ``graph``, captured into ``pool_id`` (from :meth:`for_capture`): while alive, it holds that pool."""
        if pool_id == self._id:
            self._graphs.add(graph)


def is_capturing() -> bool:
    """True while this thread is capturing a region (with either backend)."""
    return getattr(_capturing, "active", False)


#: How many whole-step warm-ups or captures are running. Process-wide, not per thread: a step's backward runs on
#: autograd's device threads.
step_depth = 0


@contextlib.contextmanager
def whole_step() -> Iterator[None]:
    """While a whole step warms up or is captured, regions run their symbols as plain code (``cudagraphex.step``)."""
    global step_depth
    step_depth += 1
    try:
        yield
    finally:
        step_depth -= 1


def capture_stream(device: torch.device) -> torch.cuda.Stream:
    """The side stream every capture on ``device`` runs on, one per device for the process.

    cuBLAS keeps a workspace (about 33 MiB on an H200) for each stream that runs a matmul, until the process ends.
    One capture stream bounds that to one workspace, however many functions capture and are deleted. Call with
    ``_capture_lock`` held.
    """
    stream = _capture_streams.get(device.index)
    if stream is None:
        stream = _capture_streams[device.index] = torch.cuda.Stream(device)
    return stream


@contextlib.contextmanager
def on_capture_stream(device: torch.device) -> Iterator[torch.cuda.Stream]:
    """Runs the block on the capture stream of ``device`` with ``_capture_lock`` held.

    The stream first waits for the work queued on the current stream; after the block, the current stream waits for
    the block's work. A block that raises skips that wait: its handler decides what the failed work leaves behind.
    """
    with _capture_lock, torch.cuda.device(device):
        stream = capture_stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            yield stream
        torch.cuda.current_stream(device).wait_stream(stream)


#: Per thread, the devices whose capture stream already has this thread's cuBLAS workspace.
_blas_ready = threading.local()
#: The devices whose autograd thread has one (autograd keeps one thread per device for the process).
_autograd_blas_ready: set[int] = set()


def _run_matmuls(device: torch.device) -> None:
    """Runs the two kinds of cuBLAS matmul PyTorch uses (plain, and with a bias through cuBLASLt) once on the capture
    stream of ``device``; this thread then has its workspace for that stream."""
    with on_capture_stream(device):
        a = torch.ones(2, 2, device=device)
        torch.mm(a, a)
        torch.addmm(a[0], a, a)
    _blas_ready.__dict__.setdefault("devices", set()).add(device.index)


class _MatmulsInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        _run_matmuls(grad.device)
        _autograd_blas_ready.add(grad.device.index)
        return grad


def allocate_blas_workspaces(device: torch.device, *, autograd_thread: bool = False) -> None:
    """Has cuBLAS allocate its workspace for the capture stream outside any capture: this thread's, and with
    ``autograd_thread`` the one of autograd's thread for ``device``, where the backward inside a captured step runs.

    cuBLAS allocates a workspace (32 MiB on an H100) for each thread and stream at their first matmul and keeps it for
    the life of the process. Allocated inside a capture, it would come from that graph's pool, count as the graph's
    memory, and keep the pool's segment after the graph is gone. Call before measuring what a capture adds, and not
    while holding ``_capture_lock`` (the matmuls take it: the capture stream runs nothing while a capture records).
    """
    if device.index not in getattr(_blas_ready, "devices", ()):
        _run_matmuls(device)
    if autograd_thread and device.index not in _autograd_blas_ready and not torch.is_inference_mode_enabled():
        x = torch.zeros(2, device=device, requires_grad=True)
        with torch.enable_grad():
            _MatmulsInBackward.apply(x).sum().backward()


class CudaBackend:
    """Captures with ``torch.cuda.CUDAGraph`` on the device's capture stream."""

    name = "cuda"
    device_type = "cuda"

    def prepare(self, device: torch.device) -> None:
        """Readies this thread to capture on ``device`` without adding process-wide caches to a graph's pool."""
        allocate_blas_workspaces(device)

    def new_pool(self, device: torch.device) -> Any:
        return torch.cuda.graph_pool_handle()

    def reserved_bytes(self, device: torch.device) -> int:
        return torch.cuda.memory_reserved(device)

    def peak_allocated_bytes(self, device: torch.device) -> int:
        """The process's peak allocated memory on ``device`` (read only: the user's peak statistics stay as they are)."""
        return torch.cuda.max_memory_allocated(device)

    def release(self, tensor: torch.Tensor) -> bool:
        """Gives ``tensor``'s memory back to its pool during a capture, so that later allocations of the capture may
        take it; the tensor keeps its address and no longer frees it (``runtime.release`` says when that is sound).
        False where the caching allocator does not own the memory."""
        cdata = tensor.untyped_storage()._cdata
        if not torch._C._has_Standard_Deleter(cdata):
            return False
        torch._C._free_And_Remove_DeleterFn(cdata)
        return True

    def own_storage_refs(self, storage: torch.UntypedStorage) -> int:
        """References cudagraphex's capture machinery holds to ``storage``'s Python object: none on CUDA."""
        return 0

    def free(self, tensor: torch.Tensor) -> bool:
        """Frees ``tensor``'s memory during an eager run, as a ``del`` of its last reference would, by resizing its
        storage to 0 bytes: a later read fails instead of reading reused memory. False for a storage that cannot be
        resized (memory the caching allocator does not own)."""
        try:
            tensor.untyped_storage().resize_(0)
        except RuntimeError:
            return False
        return True

    def capture(
        self,
        fn: Callable,
        args: Sequence[Any],
        *,
        pool: Any,
        device: torch.device,
        static: Sequence[int],
        mutated: Sequence[int],
    ) -> tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, ...]]:
        """Records ``fn(*args)`` into a new graph that allocates from ``pool``.

        No device-wide synchronisation and no ``empty_cache`` (both would break another thread's capture); the capture
        stream waits for the current stream instead. Raises :class:`CaptureFailed` with the RNG state restored.
        """
        rng_state = torch.cuda.get_rng_state(device)
        graph = torch.cuda.CUDAGraph()
        with on_capture_stream(device) as stream:
            gc_enabled = gc.isenabled()
            gc.disable()  # a collection during capture may free tensors and record events on other streams
            _capturing.active = True
            try:
                graph.capture_begin(pool=pool, capture_error_mode="thread_local")
                try:
                    outputs = fn(*args)
                finally:
                    with warnings.catch_warnings():
                        # A region of views alone records no kernel; its empty graph replays as it should.
                        warnings.filterwarnings("ignore", message="The CUDA Graph is empty")
                        graph.capture_end()
            except BaseException as e:
                if PROTECTIONS["restore_rng_after_capture"]:
                    _reset_generator(stream, rng_state, device)
                raise CaptureFailed(f"{type(e).__name__}: {e}") from e
            finally:
                _capturing.active = False
                if gc_enabled:
                    gc.enable()
        return graph, tuple(outputs)


def expanded_dims(t: torch.Tensor) -> tuple[int, ...]:
    """The dims along which ``t`` repeats one element (stride 0), as ``expand`` makes them."""
    return tuple(d for d in range(t.dim()) if t.stride(d) == 0 and t.size(d) > 1)


def unexpand(t: torch.Tensor, dims: Sequence[int]) -> torch.Tensor:
    """``t`` without the repetition along ``dims``: the part of it that holds distinct memory."""
    for d in dims:
        t = t.narrow(d, 0, 1)
    return t


def _reset_generator(stream: torch.cuda.Stream, rng_state: torch.Tensor, device: torch.device) -> None:
    """Brings the device's default generator back to where it was before a failed capture.

    A capture that fails never runs ``capture_epilogue``, which leaves the generator believing it is still capturing:
    every later random op then fails ("Offset increment outside graph capture"). An empty capture runs the prologue
    and the epilogue, which clears that state; the seed and offset are then restored.
    """
    empty = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "the CUDA Graph is empty"
        empty.capture_begin(capture_error_mode="thread_local")
        empty.capture_end()
    torch.cuda.set_rng_state(rng_state, device)


class EmulatedGraph:
    """Replays a region on the CPU into the output tensors of its capture, as a CUDA graph writes its pool.

    Like a CUDA graph it keeps no reference to static inputs: a replay reads the memory of the current call's static
    inputs, which the runtime has checked to be at the captured addresses, with the dtype, shape and strides they had
    at capture, as a graph's kernels do. Everything else (input buffers, host values) is frozen at capture.
    """

    def __init__(self, fn: Callable, args: Sequence[Any], static: Sequence[int], outputs: Sequence[torch.Tensor]):
        self._fn = fn
        self._frozen = [None if i in static else _freeze(a) for i, a in enumerate(args)]
        self._static = tuple((i, args[i].dtype, args[i].size(), args[i].stride()) for i in static)
        self._outputs = tuple(outputs)
        #: Anchors of other graphs whose memory a real replay of this graph may overwrite (``runtime.release``).
        self.overwrites: list = []

    def replay(self, args: Sequence[Any]) -> None:
        call_args = [_thaw(a) for a in self._frozen]
        for i, dtype, size, stride in self._static:
            call_args[i] = _as_captured(args[i], dtype, size, stride)
        results = self._fn(*call_args)
        if self.overwrites:  # after the reads, before the writes of the outputs, which may live in that memory
            from cudagraphex.runtime.release import poison

            poison(self.overwrites)
        for target, fresh in zip(self._outputs, results, strict=True):
            if target is None:
                continue
            if fresh.untyped_storage().data_ptr() != target.untyped_storage().data_ptr():
                dims = expanded_dims(target)
                unexpand(target, dims).copy_(unexpand(fresh, dims))


class _FrozenView(NamedTuple):
    base: torch.Tensor
    size: torch.Size
    stride: tuple[int, ...]
    offset: int


def _freeze(a: Any) -> Any:
    """What a replay reads of a non-static argument. A CUDA graph keeps addresses, not tensor objects: for a view (an
    expanded input buffer, say) only its base is kept and the view is rebuilt per replay, so that storage use counts,
    which the runtime's liveness check compares, are those a real graph leaves."""
    if isinstance(a, torch.Tensor) and a._base is not None:
        return _FrozenView(a._base, a.size(), a.stride(), a.storage_offset())
    return a


def _thaw(a: Any) -> Any:
    return a.base.as_strided(a.size, a.stride, a.offset) if isinstance(a, _FrozenView) else a


def _as_captured(a: torch.Tensor, dtype: torch.dtype, size: torch.Size, stride: tuple[int, ...]) -> torch.Tensor:
    """The memory at ``a``'s address read as a tensor of the captured ``dtype``, ``size`` and ``stride``: ``a``
    itself where they are ``a``'s; beyond ``a``'s storage, an error (a real graph would read memory it does not own)."""
    if a.dtype == dtype and a.size() == size and a.stride() == stride:
        return a
    offset_bytes = a.storage_offset() * a.element_size()
    if offset_bytes % dtype.itemsize:
        raise RuntimeError(f"a static input's address is not aligned for the captured {dtype}")
    view = torch.empty(0, dtype=dtype, device=a.device)
    return view.set_(a.untyped_storage(), offset_bytes // dtype.itemsize, size, stride)


class EmulatedBackend:
    """The CPU replay backend: an explicit testing and debugging mode that treats CPU tensors as the GPU path would.

    Capture remembers the region's callable and the tensors it was captured with (static inputs and the graph's input
    buffers), and keeps the outputs of one run as the graph's output buffers; it then undoes that run's side effects
    (in-place writes to inputs, RNG draws), as a real capture has none, and keeps the version counters its ops bumped,
    as the ops a real capture records bump them. Replay runs the callable again on the same tensors and copies the
    results into those output buffers, so a held output is overwritten exactly when a real graph would overwrite it,
    and values frozen at capture (host numbers) stay frozen.
    """

    name = "emulate"
    device_type = "cpu"

    def prepare(self, device: torch.device) -> None:
        """Nothing to ready on the CPU."""

    def new_pool(self, device: torch.device) -> Any:
        return object()

    def reserved_bytes(self, device: torch.device) -> int:
        return 0

    def peak_allocated_bytes(self, device: torch.device) -> int:
        return 0

    def release(self, tensor: torch.Tensor) -> bool:
        """Nothing is freed on the CPU. As the caching allocator would, the running capture puts outputs it allocated
        in that memory (:func:`_into_given_back`), and a replay that may reuse it overwrites it
        (``EmulatedGraph.overwrites``)."""
        given_back = getattr(_capturing, "given_back", None)
        if given_back is not None:
            given_back.append(tensor.untyped_storage())
        return True

    def own_storage_refs(self, storage: torch.UntypedStorage) -> int:
        """References to ``storage``'s Python object that the emulation holds: one per live output it moved into that
        given-back memory (``_into_given_back``)."""
        return sum(ref() is not None for ref in _living_in.get(storage.data_ptr(), []))

    def free(self, tensor: torch.Tensor) -> bool:
        """Where a CUDA eager run frees ``tensor``'s memory, fills it with bytes 0xFF instead (NaN in every floating
        dtype), so that a tensor freed while something still reads it shows as a wrong result."""
        with torch.no_grad():
            _bytes_of(tensor.untyped_storage()).fill_(255)
        return True

    def capture(
        self,
        fn: Callable,
        args: Sequence[Any],
        *,
        pool: Any,
        device: torch.device,
        static: Sequence[int],
        mutated: Sequence[int],
    ) -> tuple[EmulatedGraph, tuple[torch.Tensor, ...]]:
        with _capture_lock:
            undo = PROTECTIONS["undo_capture_side_effects"]
            before = [(args[i], args[i].clone()) for i in mutated] if undo else []
            rng_state = torch.get_rng_state()
            _capturing.active = True
            _capturing.given_back = given_back = []
            try:
                outputs = tuple(fn(*args))
            except BaseException as e:
                raise CaptureFailed(f"{type(e).__name__}: {e}") from e
            finally:
                _capturing.active = False
                _capturing.given_back = None
                if PROTECTIONS["restore_rng_after_capture"]:
                    torch.set_rng_state(rng_state)
                with torch.no_grad():
                    for tensor, value in before:
                        tensor.data.copy_(value)  # through .data: the undo itself moves no version counter
            _into_given_back(outputs, args, given_back)
        return EmulatedGraph(fn, args, static, outputs), outputs


#: Per given-back storage (by address), the outputs living in its memory (``_into_given_back``), weakly.
_living_in: dict[int, list[weakref.ref]] = {}


def _into_given_back(
    outputs: Sequence[torch.Tensor | None], args: Sequence[Any], given_back: list[torch.UntypedStorage]
) -> None:
    """Moves each storage of ``outputs`` that the capture allocated (no input's, no view's) into the first given-back
    storage it fits, on a storage object of its own at that address, as a CUDA capture may allocate it in a block
    given back before. Each is used once, so the outputs stay apart; it lives as long as the tensors moved into it."""
    if not given_back:
        return
    inputs = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
    by_storage: dict[int, list[torch.Tensor]] = {}
    for out in outputs:
        if out is not None:
            by_storage.setdefault(out.untyped_storage().data_ptr(), []).append(out)
    free = list(given_back)
    for ptr, members in by_storage.items():
        storage = members[0].untyped_storage()
        if ptr in inputs or any(m._is_view() for m in members):
            continue
        block = next((b for b in free if b.nbytes() >= storage.nbytes()), None)
        if block is None:
            continue
        free.remove(block)
        moved = torch._C._construct_storage_from_data_pointer(block.data_ptr(), block.device, storage.nbytes())
        with torch.no_grad():  # no values: as after a CUDA capture, the first replay writes them
            for m in members:
                m.set_(moved, m.storage_offset(), m.size(), m.stride())
                weakref.finalize(m, _moved_out, block.data_ptr(), [block])
        living = [ref for ref in _living_in.get(block.data_ptr(), []) if ref() is not None]
        _living_in[block.data_ptr()] = living + [weakref.ref(m) for m in members]


def _moved_out(address: int, block: list[torch.UntypedStorage]) -> None:
    """Finalizer of an output moved into given-back memory: lets the block go, and forgets the address with the last
    output living there."""
    block.clear()
    living = [ref for ref in _living_in.get(address, []) if ref() is not None]
    if living:
        _living_in[address] = living
    else:
        _living_in.pop(address, None)


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def overwrite_given_back(storage: torch.UntypedStorage) -> None:
    """Fills ``storage``, given back, with bytes 0xFF (NaN in every floating dtype, -1 in integers), as a replay that
    reuses its memory does, except where outputs of a graph live in it (no other allocation can take those bytes)."""
    living = [_distinct_elements(t) for ref in _living_in.get(storage.data_ptr(), []) if (t := ref()) is not None]
    with torch.no_grad():
        kept = [t.clone() for t in living]
        _bytes_of(storage).fill_(255)
        for t, value in zip(living, kept, strict=True):
            t.copy_(value)


def _distinct_elements(t: torch.Tensor) -> torch.Tensor:
    """``t`` without the repeats of a dimension it broadcasts (stride 0, as ``expand`` makes): a tensor that can be
    written."""
    for dim, (size, stride) in enumerate(zip(t.shape, t.stride())):
        if stride == 0 and size > 1:
            t = t.narrow(dim, 0, 1)
    return t


_BACKENDS = {"cuda": CudaBackend, "emulate": EmulatedBackend}


def backend_for(name: str) -> CudaBackend | EmulatedBackend:
    """A new backend object for ``name`` ("cuda" or "emulate")."""
    return _BACKENDS[name]()
