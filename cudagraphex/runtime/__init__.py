"""Capture and replay of the regions of one compiled function.

The executor builds one :class:`GraphedRegion` per region (``region``). A call of a region replays one of its
captured instances (``instance``) when that instance's guards hold, or captures one, or runs the region eagerly. The
units, each with its invariants at its top:

* ``guards``: the fast path's C++ checks of layouts and addresses (step graphs use them too);
* ``staging``: how a graph gets its inputs (static, read in place, copied into buffers);
* ``instance``: one captured graph: its guards, capture and replay;
* ``handout``: how a graph's outputs reach the caller (anchors, aliases, copies, version counters);
* ``liveness``: pools, and when a replay may overwrite the memory it writes;
* ``region``: which instance runs a call, captures, eager fallbacks, and what a compiled function owns;
* ``options``: the executor's options, what it knows of a region, its errors.
"""

from cudagraphex.runtime.options import GraphOptions, ParameterMovedError, RegionInfo, StrictModeError
from cudagraphex.runtime.region import FunctionGraphs, GraphedRegion

__all__ = [
    "FunctionGraphs",
    "GraphOptions",
    "GraphedRegion",
    "ParameterMovedError",
    "RegionInfo",
    "StrictModeError",
]
