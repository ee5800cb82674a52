"""One call of each mode, the same for every variant (a variant supplies the model), and what the correctness check
compares:

* ``inference``: ``model(*args)`` under ``torch.no_grad``.
* ``train_fwd``: ``model(*args)`` with autograd recording; the output and its graph are dropped.
* ``train_bwd``: the forward runs once when the case is made; each call is
  ``torch.autograd.grad(out, params, grad_out, retain_graph=True)``, which returns the gradients instead of
  accumulating them into ``.grad``, so every call does the same work.
* ``train_step``: ``out = model(*args)``, ``out.backward(grad_out)``, ``opt.step()``,
  ``opt.zero_grad(set_to_none=True)``, with the case's own AdamW (:func:`make_optimizer`, :func:`train_step`).
  ``collect`` starts from the state the case started from (:meth:`StepStart.collect`), so that every variant
  compares the same step: the output, the gradients (as AdamW's first moments) and the output after the step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

__all__ = [
    "Case",
    "StepStart",
    "backward_only_case",
    "check_mode",
    "copy_of",
    "make_optimizer",
    "module_case",
    "no_op",
    "params_of",
    "train_step",
]


def no_op() -> None:
    return None


def check_mode(mode: str, modes: tuple[str, ...]) -> None:
    if mode not in modes:
        raise ValueError(f"mode {mode!r} is not applicable: this variant runs {', '.join(modes)} only")


def backward_only_case(out: torch.Tensor, params: Sequence[torch.Tensor], grad_out: torch.Tensor | None) -> Case:
    """``train_bwd``: each call replays the backward of the one forward that produced ``out``."""
    held = {"out": out}

    def grads() -> tuple[torch.Tensor | None, ...]:
        return torch.autograd.grad(held["out"], params, grad_out, retain_graph=True, allow_unused=True)

    def call() -> None:
        grads()

    return Case(call, lambda: [copy_of(g) for g in grads()], held.clear)


@dataclass
class Case:
    """One variant in one mode, ready to run. Call :attr:`close` when done, to free what the case holds."""

    call: Callable[[], None]
    collect: Callable[[], list[torch.Tensor | None]]
    close: Callable[[], None] = field(default=no_op)


def copy_of(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.detach().clone()


def params_of(module: nn.Module) -> list[torch.nn.Parameter]:
    return [p for p in module.parameters() if p.requires_grad]


def module_case(
    fn: Callable[..., torch.Tensor],
    module: nn.Module,
    mode: str,
    args: Sequence[torch.Tensor],
    grad_out: torch.Tensor | None,
    before_call: Callable[[], None] = no_op,
) -> Case:
    """The case of mode ``mode`` for ``fn``, a callable with the signature of ``module`` that uses its parameters.

    ``before_call`` runs before every call of ``fn`` (``torch.compiler.cudagraph_mark_step_begin`` for
    reduce-overhead). Training modes need ``grad_out``, the cotangent of the output. ``train_bwd`` runs the forward
    once, here.
    """
    params = params_of(module)

    if mode == "inference":

        def forward() -> torch.Tensor:
            before_call()
            with torch.no_grad():
                return fn(*args)

        def call() -> None:
            forward()

        return Case(call, lambda: [copy_of(forward())])

    if mode == "train_fwd":

        def call() -> None:
            before_call()
            fn(*args)

        def collect() -> list[torch.Tensor | None]:
            before_call()
            return [copy_of(fn(*args))]

        return Case(call, collect)

    if mode == "train_bwd":
        before_call()
        return backward_only_case(fn(*args), params, grad_out)

    if mode == "train_step":
        opt = make_optimizer(params)
        step = train_step(fn, opt, grad_out, before_call)
        return StepStart(params, opt).case(lambda: step(*args))

    raise ValueError(f"unknown mode {mode!r}")


def make_optimizer(params: Sequence[torch.nn.Parameter]) -> torch.optim.AdamW:
    """The optimizer of a ``train_step`` case: ``AdamW(params, lr=1e-3, capturable=True, foreach=True)`` on CUDA
    (capturable: its step counter stays on the device, which graph capture needs). AdamW is capturable on CUDA only; on
    the CPU (the suite's own tests) it is the fused AdamW, whose step counter is a tensor too, so that there as well a
    step reads no value back to the host."""
    if any(p.is_cuda for p in params):
        return torch.optim.AdamW(params, lr=1e-3, capturable=True, foreach=True)
    return torch.optim.AdamW(params, lr=1e-3, fused=True)


def train_step(
    fn: Callable[..., torch.Tensor],
    opt: torch.optim.Optimizer,
    grad_out: torch.Tensor | None,
    before_call: Callable[[], None] = no_op,
) -> Callable[..., torch.Tensor]:
    """The ``train_step`` call of every variant: ``step(*args)`` runs ``before_call()``, ``out = fn(*args)``,
    ``out.backward(grad_out)``, ``opt.step()``, ``opt.zero_grad(set_to_none=True)``, and returns ``out``.

    The gradients are None between calls, so each call's backward allocates them afresh; whole-step graphs capture
    this same function (the captured ``zero_grad`` drops the references to gradients the graph's pool holds).
    """

    def train_step_call(*args: torch.Tensor) -> torch.Tensor:
        before_call()
        out = fn(*args)
        out.backward(grad_out)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return out

    return train_step_call


class StepStart:
    """The state a ``train_step`` case starts from: its parameters (copied to the host when the case is made) and its
    optimizer's state, all zeros (a fresh AdamW's state, once it exists)."""

    def __init__(self, params: Sequence[torch.nn.Parameter], opt: torch.optim.Optimizer) -> None:
        self.params = params
        self.opt = opt
        # On the host: the copy would otherwise count in the variant's peak GPU memory.
        self.values = [p.detach().to("cpu", copy=True) for p in params]

    def collect(self, step: Callable[[], torch.Tensor]) -> list[torch.Tensor | None]:
        """Puts the parameters and the optimizer state back to the start, in place (graphs keep their addresses), runs
        ``step`` twice, and returns copies of: the first call's output; every parameter's first moment after it
        (``exp_avg``, which one step from zero state makes (1 - beta1) x the gradient); the second call's output,
        computed with the parameters the first call's optimizer step made.

        The parameters are not compared directly: AdamW's first update is about ``lr`` in every element whatever its
        gradient (``lr * g / (|g| + eps)``), so where the gradient is rounding noise (an attention's key bias, whose
        gradient is zero in exact arithmetic) variants differ by up to ``2 * lr``; the output after the step does not
        depend on those elements."""
        with torch.no_grad():
            for p, value in zip(self.params, self.values, strict=True):
                p.copy_(value)
            for state in self.opt.state.values():
                for value in state.values():
                    if isinstance(value, torch.Tensor):
                        value.zero_()
        first = copy_of(step())
        state = self.opt.state
        moments = [copy_of(state[p]["exp_avg"]) if p in state else None for p in self.params]
        return [first, *moments, copy_of(step())]

    def case(self, step: Callable[[], torch.Tensor], close: Callable[[], None] = no_op) -> Case:
        """The case whose calls run ``step`` and whose :meth:`collect` starts from this state."""

        def call() -> None:
            step()

        return Case(call, lambda: self.collect(step), close)
