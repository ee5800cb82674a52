"""Which inputs of a graph are static, decided by what each input is, never by its position.

A static input is read (and written) by the graph at the address it had at capture time, so it is never copied.
Every other tensor input is *copied* into a buffer that the graph owns before each replay, except a caller's tensor
that stays where it was: a graph captured while it had not moved since the warm-up reads it in place.
"""

from __future__ import annotations

import enum
from collections.abc import Collection, Sequence
from typing import Any

from thunder.core.proxies import Proxy, ProxyTag, TensorProxy

__all__ = ["InputKind", "classify_inputs", "static_names"]


class InputKind(enum.Enum):
    """How a graph receives one of its inputs, and what happens when that input's address changes."""

    #: Copied into a graph-owned buffer before each replay (and copied back after it if the graph writes to it).
    COPIED = "copied"
    #: A parameter or buffer (Thunder's ``STATIC_MEMORY_LOCATION`` tag). A new address means a new capture.
    PARAMETER = "parameter"
    #: Produced by another graph of the same compiled function, e.g. a forward output saved for backward.
    GRAPH_OUTPUT = "graph output"
    #: Declared static through the legacy ``num_static_inputs``. A new address demotes it to ``COPIED``.
    DECLARED = "declared static"
    #: An input of the trace that the graph writes in place (a KV cache, a running buffer).
    MUTATED = "written in place"
    #: A tensor the caller passes in (an input of the trace, one saved from it for backward, a cotangent): copied
    #: unless it is at the address it had at the warm-up when a graph is captured: that graph reads it in place and
    #: replays only while it stays there. Its first move demotes it to ``COPIED``.
    CALLER = "caller's tensor"
    #: A Python value (only reaches a graph through a ``can_fuse`` override): frozen at capture, so a new value needs
    #: a new graph.
    HOST_VALUE = "host value"

    @property
    def is_copied(self) -> bool:
        """Whether an input of this kind is copied into the graph, unless a graph reads it in place (``CALLER``)."""
        return self in (InputKind.COPIED, InputKind.CALLER)

    @property
    def is_static(self) -> bool:
        """Whether every graph reads an input of this kind at the address it had at capture."""
        return not self.is_copied and self is not InputKind.HOST_VALUE


def classify_inputs(
    inputs: Sequence[Proxy],
    *,
    graph_outputs: Collection[str],
    declared_static: Collection[str],
    mutated_trace_inputs: Collection[str],
    caller_inputs: Collection[str] = (),
) -> list[InputKind]:
    """The kind of each region input: tags first, then provenance, then declarations and in-place writes."""
    kinds = []
    for p in inputs:
        if not isinstance(p, TensorProxy):
            kinds.append(InputKind.HOST_VALUE)
        elif ProxyTag.STATIC_MEMORY_LOCATION in p.tags:
            kinds.append(InputKind.PARAMETER)
        elif p.name in graph_outputs:
            kinds.append(InputKind.GRAPH_OUTPUT)
        elif p.name in declared_static:
            kinds.append(InputKind.DECLARED)
        elif p.name in mutated_trace_inputs:
            kinds.append(InputKind.MUTATED)
        elif p.name in caller_inputs:
            kinds.append(InputKind.CALLER)
        else:
            kinds.append(InputKind.COPIED)
    return kinds


def static_names(inputs: Sequence[Any], kinds: Sequence[InputKind]) -> frozenset[str]:
    """The names of the inputs that ``classify_inputs`` found static."""
    return frozenset(p.name for p, kind in zip(inputs, kinds, strict=True) if kind.is_static)
