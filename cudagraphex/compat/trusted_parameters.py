"""An opt-in for the last part of a replayed call's host time: Thunder's per-parameter prologue checks."""

from __future__ import annotations

from typing import Any

from thunder.core.compile_data import get_compile_data
from thunder.core.trace import TraceCtx
from thunder.transforms.prune_prologue_checks import PrunePrologueChecks

__all__ = ["PruneParameterChecks"]

#: The compile-data attribute that tells cudagraphex the function was compiled with :class:`PruneParameterChecks`.
TRUSTED_ATTRIBUTE = "_cudagraphex_parameters_trusted"


class PruneParameterChecks(PrunePrologueChecks):
    """Drops Thunder's prologue checks of module parameters and buffers, for users who promise not to replace them.

    Thunder checks the metadata of every parameter on every call; for a model with a hundred parameters that is
    most of the host time of a replayed call. This transform removes those checks (it is Thunder's
    ``PrunePrologueChecks``) and makes cudagraphex enforce the promise: a graph that finds one of its parameters at
    a new address raises :class:`~cudagraphex.ParameterMovedError` instead of capturing again. After replacing
    parameters (``module.to()``, ``load_state_dict(assign=True)``), compile again. Parameters that no graph reads
    are not checked; neither are in-place changes that keep the address (``requires_grad_``).

    Use: ``thunder.jit(model, executors=[cudagraphex, ...], transforms=[PruneParameterChecks()])``.
    """

    def __init__(self) -> None:
        super().__init__(prune_all_checks=False)

    def transform_traces_pre_prologue(
        self, prologue_trace: TraceCtx, compute_trace: TraceCtx, epilogue_trace: TraceCtx | None, **kwargs: Any
    ) -> tuple[TraceCtx, TraceCtx, TraceCtx | None]:
        cd = get_compile_data()
        if cd is not None:
            setattr(cd, TRUSTED_ATTRIBUTE, True)
        return super().transform_traces_pre_prologue(prologue_trace, compute_trace, epilogue_trace, **kwargs)
