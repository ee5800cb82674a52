"""Entry points for code written against older Thunder: the transform adapter, ``use_cudagraphs``, and the plugin.

- :class:`CUDAGraphTransform` is a drop-in for ``thunder.transforms.cudagraph.CUDAGraphTransform``: a thin
  post-optimization transform that runs a :class:`~cudagraphex.CUDAGraphExecutor`'s ``fusion_pass`` on the forward
  trace, and on the backward trace with the legacy ``num_static_inputs``.
- :func:`jit` and :func:`install_use_cudagraphs_shim` accept the ``use_cudagraphs=`` keyword that Thunder 0.2.6 rejects.
- Importing cudagraphex registers the ``"cudagraphex"`` plugin, for ``thunder.compile(model, plugins="cudagraphex")``,
  and makes Thunder's default recipe fall back from nvFuser, where it is not installed, when that plugin is used.
"""

from __future__ import annotations

import functools
import itertools
import logging
import warnings
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import thunder
import thunder.plugins
from thunder.core.proxies import TensorProxy
from thunder.core.recipe import Plugin, PluginPolicy, Recipe
from thunder.core.symbol import BoundSymbol
from thunder.core.trace import TraceCtx
from thunder.core.transform_common import Transform
from thunder.extend import Executor, get_executor
from thunder.recipes import BaseRecipe
from typing_extensions import Self

from cudagraphex.executor import CUDAGraphExecutor, cudagraphex
from cudagraphex.planning.regions import trace_kind
from cudagraphex.runtime import FunctionGraphs

__all__ = ["CUDAGraphTransform", "CUDAGraphsPlugin", "install_use_cudagraphs_shim", "jit"]

logger = logging.getLogger("cudagraphex")

_adapter_ids = itertools.count()


class _TransformExecutor(CUDAGraphExecutor):
    """The executor behind a :class:`CUDAGraphTransform`; asks the transform's ``can_fuse``."""

    def __init__(self, transform: CUDAGraphTransform, **options: Any) -> None:
        super().__init__(f"cudagraphex_transform_{next(_adapter_ids)}", **options)
        self._transform = transform
        self._numbers = itertools.count()
        #: (number, weak reference) of the graphs of each function this executor compiled, in compile order.
        self._compiled: list[tuple[int, weakref.ref[FunctionGraphs]]] = []

    def can_fuse(self, bsym: BoundSymbol) -> bool:
        return self._transform.can_fuse(bsym)

    def _can_fuse_owner(self) -> str:
        return type(self._transform).__name__

    def _function_graphs(self) -> FunctionGraphs:
        graphs = super()._function_graphs()
        if not any(ref() is graphs for _, ref in self._compiled):
            self._compiled = [(n, ref) for n, ref in self._compiled if ref() is not None]
            self._compiled.append((next(self._numbers), weakref.ref(graphs)))
        return graphs

    def compiled_graphs(self) -> list[tuple[int, FunctionGraphs]]:
        """The graphs of the functions compiled with this executor that are still alive, numbered in compile order."""
        alive = [(n, ref()) for n, ref in self._compiled]
        return [(n, graphs) for n, graphs in alive if graphs is not None]


class _GraphCache(Mapping):
    """A live, read-only view of the graphs a transform captured, in the shape of Thunder's ``cuda_graph_cache``."""

    __slots__ = ("_executor",)

    def __init__(self, executor: _TransformExecutor) -> None:
        self._executor = executor

    def _entries(self) -> dict[tuple[int, str, int], Any]:
        return {
            (number, region.name, i): instance.graph
            for number, graphs in self._executor.compiled_graphs()
            for region in graphs.regions()
            for i, instance in enumerate(region.instances)
        }

    def __getitem__(self, key: tuple[int, str, int]) -> Any:
        return self._entries()[key]

    def __iter__(self) -> Iterator[tuple[int, str, int]]:
        return iter(list(self._entries()))

    def __len__(self) -> int:
        return len(self._entries())

    def __repr__(self) -> str:
        return f"{type(self).__name__}({list(self)})"


class _GraphRunner:
    """What Thunder's tests read of ``CUDAGraphTransform.cuda_graph_runner``: its ``cuda_graph_cache``."""

    __slots__ = ("_cache",)

    def __init__(self, executor: _TransformExecutor) -> None:
        self._cache = _GraphCache(executor)

    @property
    def cuda_graph_cache(self) -> Mapping[tuple[int, str, int], Any]:
        """One entry per captured graph of the functions compiled with the transform that are still alive.

        Keys are ``(function, region, graph)``: the function's number in the order the transform compiled it, the
        region's fusion name (``CUDAGraphN``) and the graph's number within the region; values are the captured graphs
        (``torch.cuda.CUDAGraph``, or the emulate backend's stand-in). The mapping is read-only and live: it follows
        later captures, and the graphs of a function that was freed leave it.
        """
        return self._cache


class CUDAGraphTransform(Transform):
    """Drop-in for Thunder's ``CUDAGraphTransform``, backed by cudagraphex's runtime.

    Use it as ``thunder.jit(fn, transforms=[CUDAGraphTransform()])``. Subclass it and override :meth:`can_fuse` to keep
    symbols out of graphs. Backward traces are recognised by Thunder's ``TraceTag.BACKWARD``; for them the tensors
    saved for backward are declared static (matched to graph inputs by name, demoted to copied inputs if their address
    changes), as the old executor's ``num_static_inputs`` did, except a batch the forward got from its caller.

    Args:
        share_mem_pool: whether the graphs of one compiled function share one memory pool per device. Unlike
            Thunder's transform this is safe and the default: the runtime checks liveness before every replay.
        **options: further :class:`~cudagraphex.CUDAGraphExecutor` options (``min_region_size``, ``strict``, ...).

    Raises:
        ValueError: for an invalid option.
        TypeError: for an option :class:`~cudagraphex.CUDAGraphExecutor` does not take, or ``share_pool``.

    ``cuda_graph_runner.cuda_graph_cache``, as on Thunder's transform, maps each graph captured so far to an entry (see
    :attr:`cuda_graph_runner`); the transform holds the functions it compiled and their graphs by weak reference only.
    """

    def __init__(self, *, share_mem_pool: bool = True, **options: Any) -> None:
        super().__init__()
        if not isinstance(share_mem_pool, bool):
            raise ValueError(f"share_mem_pool must be a bool, got {share_mem_pool!r}")  # noqa: TRY004 (contract)
        if "share_pool" in options:
            raise TypeError("CUDAGraphTransform takes share_mem_pool, as Thunder's transform does, not share_pool")
        self.executor = _TransformExecutor(self, share_pool=share_mem_pool, **options)
        self._runner = _GraphRunner(self.executor)

    @property
    def cuda_graph_runner(self) -> _GraphRunner:
        """Read-only stand-in for Thunder's ``CUDAGraphRunner``: only its ``cuda_graph_cache`` is provided."""
        return self._runner

    def can_fuse(self, bsym: BoundSymbol) -> bool:
        """Whether ``bsym`` may be captured; override to keep symbols out (call ``super().can_fuse``)."""
        return CUDAGraphExecutor.can_fuse(self.executor, bsym)

    def transform_trace_post_optimization(self, trace: TraceCtx, **kwargs: Any) -> TraceCtx:
        num_static_inputs = None
        if trace_kind(trace) == "backward":
            num_static_inputs = sum(isinstance(p, TensorProxy) for p in trace.args[0][0])
        return self.executor.fusion_pass(trace, num_static_inputs=num_static_inputs)


def jit(fn: Callable, /, *, use_cudagraphs: bool = True, **thunder_jit_kwargs: Any) -> Callable:
    """``thunder.jit`` that understands old Thunder's ``use_cudagraphs``.

    With ``use_cudagraphs=True`` the function is jitted with :data:`~cudagraphex.cudagraphex` first in the executors
    (before the given executors, or Thunder's defaults); with ``False`` this is plain ``thunder.jit``.
    """
    if not isinstance(use_cudagraphs, bool):
        raise ValueError(f"use_cudagraphs must be a bool, got {use_cudagraphs!r}")  # noqa: TRY004 (as old Thunder)
    if use_cudagraphs:
        executors = thunder_jit_kwargs.pop("executors", None)
        executors = list(thunder.get_default_executors() if executors is None else executors)
        if cudagraphex not in executors:
            executors.insert(0, cudagraphex)
        thunder_jit_kwargs["executors"] = executors
    return _original_jit(fn, **thunder_jit_kwargs)


_original_jit = thunder.jit


class _Shim:
    """Undo handle of :func:`install_use_cudagraphs_shim`; also a context manager."""

    def __init__(self) -> None:
        @functools.wraps(_original_jit)
        def jit_with_use_cudagraphs(fn: Callable, /, **kwargs: Any) -> Callable:
            if "use_cudagraphs" not in kwargs:
                return _original_jit(fn, **kwargs)
            warnings.warn(
                "thunder.jit(use_cudagraphs=...) is deprecated: pass executors=[cudagraphex.cudagraphex, ...] "
                "(the cudagraphex executor) instead",
                DeprecationWarning,
                stacklevel=2,
            )
            return jit(fn, **kwargs)

        self._jit = jit_with_use_cudagraphs
        thunder.jit = jit_with_use_cudagraphs

    def uninstall(self) -> None:
        """Restores ``thunder.jit`` (if the shim is still the installed one)."""
        if thunder.jit is self._jit:
            thunder.jit = _original_jit

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.uninstall()


def install_use_cudagraphs_shim() -> _Shim:
    """Lets unchanged old code call ``thunder.jit(fn, use_cudagraphs=...)``.

    Replaces ``thunder.jit`` (code that imported ``jit`` from thunder earlier keeps the original) with a wrapper that
    removes the keyword, which Thunder 0.2.6 rejects, and emits a ``DeprecationWarning`` naming the cudagraphex
    executor. Returns a handle whose ``uninstall()`` (or ``with`` block) undoes it.
    """
    return _Shim()


class CUDAGraphsPlugin(Plugin):
    """``thunder.compile(model, plugins="cudagraphex")``: adds cudagraphex after the recipe's executors.

    Without a recipe argument ``thunder.compile`` uses Thunder's default recipe, which asks for nvFuser. Where nvFuser
    is not installed and this plugin is among the recipe's plugins, that recipe uses Thunder's torch.compile fuser
    instead, or no fuser where that one is missing too, and says so once, at INFO level, on the ``cudagraphex`` logger.
    A recipe passed explicitly is used as given.

    Args:
        executor: the executor to add (default: :data:`~cudagraphex.cudagraphex`).
    """

    policy = PluginPolicy.POST

    def __init__(self, executor: CUDAGraphExecutor = cudagraphex) -> None:
        self.executor = executor

    def setup_executors(self) -> list[CUDAGraphExecutor]:
        return [self.executor]


_announced_fuser_fallback = False


def _announce_fuser_fallback(fuser: str | None) -> None:
    global _announced_fuser_fallback
    if _announced_fuser_fallback:
        return
    _announced_fuser_fallback = True
    if fuser is None:
        logger.info(
            "cudagraphex: nvFuser and Thunder's torch.compile fuser are not available; thunder.compile's default"
            " recipe runs the cudagraphex plugin without a fuser"
        )
    else:
        logger.info(
            "cudagraphex: nvFuser is not installed; thunder.compile's default recipe runs the cudagraphex plugin with"
            " Thunder's torch.compile fuser (%s) instead",
            fuser,
        )


class _DefaultRecipe(BaseRecipe):
    """Thunder's default recipe, except that with the cudagraphex plugin and no nvFuser it falls back to Thunder's
    torch.compile fuser (executor ``torchcompile``) or, where that is missing too, to no fuser."""

    def setup_executors(self) -> list[Executor]:
        if (
            "nvfuser" in self.executor_names
            and get_executor("nvfuser") is None
            and any(isinstance(p, CUDAGraphsPlugin) for p in self.plugins)
        ):
            fallback = "torchcompile" if get_executor("torchcompile") is not None else None
            names = [fallback if n == "nvfuser" else n for n in self.executor_names]
            self.executor_names = [n for i, n in enumerate(names) if n is not None and n not in names[:i]]
            self.fuser = "torch.compile" if fallback else None
            _announce_fuser_fallback(fallback)
        return super().setup_executors()


thunder.plugins.register_plugin("cudagraphex", CUDAGraphsPlugin)
# thunder.compile without a recipe builds the recipe registered under "" (BaseRecipe); one registered by someone else
# is left alone.
if Recipe._registry.get("") is BaseRecipe:
    Recipe.register("")(_DefaultRecipe)
