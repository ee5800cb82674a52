"""Whether a call runs ``torch.compile``'d code, which the row check cannot look into.

Compiled code runs kernels the dispatcher never sees, so a write it makes in place is invisible to
:class:`~cudagraphex.step.rows.RowCheck`. Every callable that ``torch.compile`` returns (a function, an
``OptimizedModule``, ``Module.compile()``, Thunder's torch.compile executor) enters its compiled code through one
wrapper of Dynamo's, ``compile_wrapper`` in ``torch/_dynamo/eval_frame.py``; a profile function set for the call sees
that wrapper's frame. Where that cannot be relied on, any ``torch.compile`` in the process counts instead: the wrapper
is not found (another torch), another profile function is set (a profiler's, which this would displace), or the call
starts inside code that Dynamo compiles frames of.
"""

from __future__ import annotations

import sys
import types
from typing import Any

import torch
from typing_extensions import Self

__all__ = ["CompiledCodeWatch"]


def _compile_wrapper_code() -> types.CodeType | None:
    from torch._dynamo import eval_frame

    try:
        consts = eval_frame._TorchDynamoContext.__call__.__code__.co_consts
    except AttributeError:
        return None
    return next((c for c in consts if isinstance(c, types.CodeType) and c.co_name == "compile_wrapper"), None)


def _inside_dynamo() -> bool:
    callback = torch._C._dynamo.eval_frame.get_eval_frame_callback()
    return callback is not None and callback is not False


class CompiledCodeWatch:
    """A context manager for one call in the current thread. ``found`` is None if no compiled code ran inside it, else
    why the call may have run some."""

    _wrapper: types.CodeType | None = None

    def __init__(self) -> None:
        self.found: str | None = None
        self._watching = False

    def __enter__(self) -> Self:
        if CompiledCodeWatch._wrapper is None:
            CompiledCodeWatch._wrapper = _compile_wrapper_code()
        if CompiledCodeWatch._wrapper is not None and sys.getprofile() is None and not _inside_dynamo():
            sys.setprofile(self._profile)
            self._watching = True
        else:
            self._unwatched()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._watching:
            sys.setprofile(None)
            self._watching = False
        elif self.found is None:
            self._unwatched()  # the call may have compiled the first graph of the process

    def _unwatched(self) -> None:
        if torch._dynamo.utils.counters["stats"]["unique_graphs"]:
            self.found = "the process has run torch.compile, and the call cannot be watched for compiled code"

    def _profile(self, frame: types.FrameType, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code is CompiledCodeWatch._wrapper:
            self.found = "the step runs torch.compile'd code, which the row check cannot look into"
            sys.setprofile(None)
            self._watching = False
