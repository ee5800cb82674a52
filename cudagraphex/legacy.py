"""Entry points for code written against older Thunder: the transform adapter, ``use_cudagraphs``, and the plugin.

- :class:`CUDAGraphTransform` is a drop-in for ``thunder.transforms.cudagraph.CUDAGraphTransform``: a thin
  post-optimization transform that runs a :class:`~cudagraphex.CUDAGraphExecutor`'s ``fusion_pass`` on the forward
  trace, and on the backward trace with the legacy ``num_static_inputs``.
- :func:`jit` and :func:`install_use_cudagraphs_shim` accept the ``use_cudagraphs=`` keyword that Thunder 0.2.6 rejects.
- Importing cudagraphex registers the ``"cudagraphex"`` plugin, for ``thunder.compile(model, plugins="cudagraphex")``.
"""

from __future__ import annotations

import functools
import itertools
import warnings
from collections.abc import Callable
from typing import Any

import thunder
import thunder.plugins
from thunder.core.proxies import TensorProxy
from thunder.core.recipe import Plugin, PluginPolicy
from thunder.core.symbol import BoundSymbol
from thunder.core.trace import TraceCtx, TraceTag
from thunder.core.transform_common import Transform
from typing_extensions import Self

from cudagraphex.executor import CUDAGraphExecutor, cudagraphex

__all__ = ["CUDAGraphTransform", "CUDAGraphsPlugin", "install_use_cudagraphs_shim", "jit"]

_adapter_ids = itertools.count()


class _TransformExecutor(CUDAGraphExecutor):
    """The executor behind a :class:`CUDAGraphTransform`; asks the transform's ``can_fuse``."""

    def __init__(self, transform: CUDAGraphTransform, **options: Any) -> None:
        super().__init__(f"cudagraphex_transform_{next(_adapter_ids)}", **options)
        self._transform = transform

    def can_fuse(self, bsym: BoundSymbol) -> bool:
        return self._transform.can_fuse(bsym)

    def _can_fuse_owner(self) -> str:
        return type(self._transform).__name__


class CUDAGraphTransform(Transform):
    """Drop-in for Thunder's ``CUDAGraphTransform``, backed by cudagraphex's runtime.

    Use it as ``thunder.jit(fn, transforms=[CUDAGraphTransform()])``. Subclass it and override :meth:`can_fuse` to keep
    symbols out of graphs. Backward traces are recognised by Thunder's ``TraceTag.BACKWARD``; for them the tensors
    saved for backward are declared static (matched to graph inputs by name, demoted to copied inputs if their address
    changes), as the old executor's ``num_static_inputs`` did.

    Args:
        share_mem_pool: whether the graphs of one compiled function share one memory pool per device. Unlike
            Thunder's transform this is safe and the default: the runtime checks liveness before every replay.
        **options: further :class:`~cudagraphex.CUDAGraphExecutor` options (``min_region_size``, ``strict``, ...).
    """

    def __init__(self, *, share_mem_pool: bool = True, **options: Any) -> None:
        super().__init__()
        self.executor = _TransformExecutor(self, share_pool=share_mem_pool, **options)

    def can_fuse(self, bsym: BoundSymbol) -> bool:
        """Whether ``bsym`` may be captured; override to keep symbols out (call ``super().can_fuse``)."""
        return CUDAGraphExecutor.can_fuse(self.executor, bsym)

    def transform_trace_post_optimization(self, trace: TraceCtx, **kwargs: Any) -> TraceCtx:
        num_static_inputs = None
        if TraceTag.BACKWARD in trace.tags:
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

    Args:
        executor: the executor to add (default: :data:`~cudagraphex.cudagraphex`).
    """

    policy = PluginPolicy.POST

    def __init__(self, executor: CUDAGraphExecutor = cudagraphex) -> None:
        self.executor = executor

    def setup_executors(self) -> list[CUDAGraphExecutor]:
        return [self.executor]


thunder.plugins.register_plugin("cudagraphex", CUDAGraphsPlugin)
