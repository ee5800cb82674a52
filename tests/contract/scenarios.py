"""Programs and executors that more than one point of the contract uses."""

from __future__ import annotations

import thunder
import torch
from thunder.extend import OperatorExecutor, register_executor

from benchmarks.models import mlp
from cudagraphex import CUDAGraphExecutor
from cudagraphex.capture import is_capturing
from tests.helpers import jit


class Keeps(CUDAGraphExecutor):
    """Keeps the symbols whose name contains ``kept`` out of graphs."""

    def __init__(self, name: str, kept: str, **kwargs):
        super().__init__(name, **kwargs)
        self.kept = kept

    def can_fuse(self, bsym):
        return self.kept not in bsym.sym.name and super().can_fuse(bsym)


def held_outputs_survive(ex) -> bool:
    model = mlp(2, 16).eval()
    jm = jit(model, ex)
    x1, x2, x3 = (torch.randn(4, 16) for _ in range(3))
    with torch.no_grad():
        jm(x1)  # warm-up
        y1 = jm(x1)  # captured and replayed
        y2 = jm(x2)
        y3 = jm(x3)
        return all(torch.equal(y, model(x)) for y, x in ((y1, x1), (y2, x2), (y3, x3)))


def accumulate(buf, x):
    buf.add_(x)
    return x * 2 + buf.sum()


fragile = OperatorExecutor("cudagraphex_test_fragile")
register_executor(fragile)


def fails_under_capture(x):
    if is_capturing():
        if x.is_cuda:
            torch.cuda.synchronize()  # not permitted while the stream captures
        raise torch.OutOfMemoryError("simulated out of memory during capture")
    return x * 3


fragile_triple = fragile.register_operator("fragile_triple", like=thunder.torch.neg, fn=fails_under_capture)
