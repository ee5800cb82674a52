"""A model stepped through ``graph_step`` beside its twin stepped by plain Thunder, compared after every call."""

from __future__ import annotations

import thunder
import torch

from benchmarks.models import mlp
from cudagraphex import explain, graph_step
from tests.helpers import jit, twin


def optimizer_for(params, backend, adam=True):
    if backend.name == "cuda" and adam:
        return torch.optim.AdamW(params, lr=1e-2, capturable=True, foreach=True)
    return torch.optim.SGD(params, lr=1e-2, momentum=0.9)  # capturable optimizers need a GPU


class Pair:
    """A model trained through ``graph_step`` and its twin trained by plain Thunder, with one step function each."""

    def __init__(
        self, backend, make_model=None, pattern="zero_first", adam=True, optimizer=None, listed=True, **options
    ):
        self.backend = backend
        model = (make_model or (lambda: mlp(2, 16)))().to(backend.device)
        self.models = [model, twin(model)]
        self.compiled = [jit(self.models[0], backend.executor), thunder.jit(self.models[1])]
        self.opts = [(optimizer or optimizer_for)(m.parameters(), backend, adam) for m in self.models]
        self.steps = [self._step_fn(i, pattern) for i in range(2)]
        # ``listed=False`` passes the one module and the one optimizer as they are.
        modules, optimizers = ([self.models[0]], [self.opts[0]]) if listed else (self.models[0], self.opts[0])
        self.step = graph_step(self.steps[0], modules=modules, optimizers=optimizers, backend=backend.name, **options)

    def _step_fn(self, i, pattern):
        model, opt = self.compiled[i], self.opts[i]

        def loss_of(x, y):
            return ((model(x) - y) ** 2).mean()

        def step(x, y):
            if pattern == "zero_first":
                opt.zero_grad()
            if pattern == "micro_batches":
                opt.zero_grad()
                total = 0
                for xs, ys in zip(x.chunk(2), y.chunk(2), strict=True):
                    loss = loss_of(xs, ys) / 2
                    loss.backward()
                    total = total + loss.detach()
                opt.step()
                return total
            loss = loss_of(x, y)
            loss.backward()
            if pattern != "accumulate":
                opt.step()
            if pattern == "zero_last":
                opt.zero_grad()
            return loss.detach()

        return step

    def batch(self, rows=4, generator=None):
        """Two tensors of ``rows`` rows, drawn on the device, or from ``generator`` (a CPU one) and moved there."""
        if generator is None:
            return torch.randn(rows, 16, device=self.backend.device), torch.randn(rows, 16, device=self.backend.device)
        return tuple(torch.randn(rows, 16, generator=generator).to(self.backend.device) for _ in range(2))

    def call(self, *args, seed=0):
        """One call of each, both after ``torch.manual_seed(seed)`` unless ``seed`` is None; returns both results after
        checking that they and the state agree."""
        if seed is not None:
            torch.manual_seed(seed)
        got = self.step(*args)
        if seed is not None:
            torch.manual_seed(seed)
        want = self.steps[1](*args)
        self.check(got, want)
        return got, want

    def check(self, got, want):
        close = assert_close if self.backend.name == "cuda" else assert_equal
        close(got, want)
        for p, q in zip(self.models[0].parameters(), self.models[1].parameters(), strict=True):
            close(p, q)
            assert (p.grad is None) == (q.grad is None)
            if p.grad is not None:
                close(p.grad, q.grad)
        for b, c in zip(self.models[0].buffers(), self.models[1].buffers(), strict=True):
            close(b, c)
        for s, t in zip(self.opts[0].state.values(), self.opts[1].state.values(), strict=True):
            for k in s:
                close(s[k], t[k])


def run_calls(pair, n, *, rows=4, first_seed=0, inputs_require_grad=False):
    for i in range(n):
        x, y = pair.batch(rows)
        pair.call(x.requires_grad_(inputs_require_grad), y, seed=first_seed + i)


def assert_close(a, b):
    # Thunder's traces with and without cudagraphex order some reductions differently (and attention's backward is
    # not deterministic); Adam turns last-bit gradient differences into parameter differences of up to ~1e-4. A stale
    # replay misses a whole step: differences of the order of the learning rate (1e-2).
    torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-3)


def assert_equal(a, b):
    torch.testing.assert_close(a, b, rtol=0, atol=0)


def replays_of(step) -> int:
    return explain(step).replays
