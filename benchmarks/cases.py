"""The modes: one call of each, the same for every variant (a variant supplies the model), and what the check compares.

* ``inference``: ``model(*args)`` under ``torch.no_grad``; compared: the output.
* ``train_step``: ``out = model(*args)``, ``out.backward(grad_out)``, ``opt.step()``, ``opt.zero_grad(set_to_none=True)``
  with the case's own AdamW (:func:`make_optimizer`, :func:`train_step`). Compared: one step from the state the case
  started from (:meth:`StepStart.collect`): the output, the gradients (as AdamW's first moments), the output after it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

MODES = ("inference", "train_step")


def _no_op() -> None:
    return None


@dataclass
class Case:
    """One variant in one mode, ready to run. Call :attr:`close` when done, to free what the case holds."""

    call: Callable[[], object]
    collect: Callable[[], list[torch.Tensor | None]]
    close: Callable[[], None] = field(default=_no_op)


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
    before_call: Callable[[], None] = _no_op,
) -> Case:
    """The case of ``mode`` for ``fn``, a callable with the signature of ``module`` that uses its parameters.

    ``before_call`` runs before every call of ``fn`` (``torch.compiler.cudagraph_mark_step_begin`` for
    reduce-overhead). ``train_step`` backpropagates ``grad_out``, the cotangent of the output.
    """
    if mode == "inference":

        def forward() -> torch.Tensor:
            before_call()
            with torch.no_grad():
                return fn(*args)

        return Case(forward, lambda: [copy_of(forward())])
    if mode == "train_step":
        params = params_of(module)
        opt = make_optimizer(params)
        step = train_step(fn, opt, grad_out, before_call)
        return StepStart(params, opt).case(lambda: step(*args))
    raise ValueError(f"unknown mode {mode!r}")


def make_optimizer(params: Sequence[torch.nn.Parameter]) -> torch.optim.AdamW:
    """``AdamW(params, lr=1e-3, capturable=True, foreach=True)`` on CUDA (capturable: its step counter stays on the
    device, which graph capture needs). On the CPU, where AdamW is not capturable, the fused AdamW, whose step counter
    is a tensor too, so that there as well a step reads no value back to the host."""
    if any(p.is_cuda for p in params):
        return torch.optim.AdamW(params, lr=1e-3, capturable=True, foreach=True)
    return torch.optim.AdamW(params, lr=1e-3, fused=True)


def train_step(
    fn: Callable[..., torch.Tensor],
    opt: torch.optim.Optimizer,
    grad_out: torch.Tensor | None,
    before_call: Callable[[], None] = _no_op,
) -> Callable[..., torch.Tensor]:
    """The ``train_step`` call of every variant: ``before_call()``, ``out = fn(*args)``, ``out.backward(grad_out)``,
    ``opt.step()``, ``opt.zero_grad(set_to_none=True)``; returns ``out``.

    The gradients are None between calls, so each backward allocates them afresh; whole-step graphs capture this same
    function (the captured ``zero_grad`` drops the references to gradients the graph's pool holds).
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
    """The state a ``train_step`` case starts from: its parameters (copied to the host, so that the copy does not count
    in the variant's peak GPU memory) and its optimizer's state, all zeros (a fresh AdamW's, once it exists)."""

    def __init__(self, params: Sequence[torch.nn.Parameter], opt: torch.optim.Optimizer) -> None:
        self.params = params
        self.opt = opt
        self.values = [p.detach().to("cpu", copy=True) for p in params]

    def collect(self, step: Callable[[], torch.Tensor]) -> list[torch.Tensor | None]:
        """Puts the parameters and the optimizer state back to the start, in place (graphs keep their addresses), runs
        ``step`` twice, and returns copies of the first output, every parameter's first moment after it (``exp_avg``:
        one step from zero state makes it (1 - beta1) x the gradient) and the second output.

        Parameters are not compared directly: AdamW's first update is about ``lr`` in every element whatever its
        gradient, so where a gradient is rounding noise (an attention's key bias) variants differ by up to ``2 * lr``;
        the output after the step does not depend on those elements."""
        with torch.no_grad():
            for p, value in zip(self.params, self.values, strict=True):
                p.copy_(value)
            for state in self.opt.state.values():
                for value in state.values():
                    if isinstance(value, torch.Tensor):
                        value.zero_()
        first = copy_of(step())
        moments = [copy_of(self.opt.state[p]["exp_avg"]) if p in self.opt.state else None for p in self.params]
        return [first, *moments, copy_of(step())]

    def case(self, step: Callable[[], torch.Tensor], close: Callable[[], None] = _no_op) -> Case:
        """The case whose calls run ``step`` and whose :meth:`collect` starts from this state."""
        return Case(step, lambda: self.collect(step), close)
