"""Verdicts on differences that come from plain Thunder moving an in-place write of the forward into its backward.

Thunder 0.2.6 without a fusion executor: ``split_into_forward_and_backward`` puts an in-place write that no forward
output needs into the backward trace. Plain Thunder's call then returns before the write, and a call or step that runs
no backward never makes it; eager and cudagraphex make it in the forward, as does Thunder with its torch.compile fusion
executor, which fuses the write with forward outputs. Each verdict says which run witnesses it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import thunder
from thunder.core.proxies import TensorProxy
from thunder.core.pytree import tree_flatten

from cudagraphex import CUDAGraphExecutor
from tests.fuzzing.compare import Failure, compare_step, observed_alike, run_alike
from tests.fuzzing.world import BackendSpec, Observations, World, compile_source, lockstep, raised_first_at_the_last

_INPUT_WRITTEN = "input NAME after the call: values"
_NO_GRADIENT = (
    "Thunder's grad transform finds no gradient, so Thunder connects outputs to autograd only where its backward"
    " trace is not empty: without a fusion executor an in-place write no forward output needs is moved into that"
    " backward"
)
#: What a whole step misses where Thunder with its torch.compile fusion executor agrees with cudagraphex.
_MISSED_BY_A_WHOLE_STEP = {
    "loss": "a whole step's loss sums the outputs that require grad, which Thunder marks as a whole, unlike eager;"
    " plain Thunder moves an in-place write of the forward into its backward, so the loss misses it, and Thunder with"
    " its torch.compile fusion executor computes the loss cudagraphex does",
    _INPUT_WRITTEN: "plain Thunder moves an in-place write of the forward into its backward, so a whole step that runs"
    " none misses it; eager gives no verdict, and Thunder with its torch.compile fusion executor writes the input as"
    " cudagraphex does",
}
_WRITTEN_BY_THUNDERS_BACKWARD = (
    "plain Thunder moves an in-place write of the forward into its backward, so a whole step that runs none misses it;"
    " eager gives no verdict, and plain Thunder given a backward at that step writes the input as cudagraphex does"
    " (and an output that is the input with it)"
)
_WRITTEN_AFTER_THE_CALL = (
    "plain Thunder moves an in-place write of the forward into its backward, so the input is not yet written after the"
    " call; eager refuses the call, and Thunder with its torch.compile fusion executor writes the input in the forward"
    " as cudagraphex does"
)
#: How an output's metadata shows that plain Thunder connected it to autograd and cudagraphex did not.
_CONNECTED_ONLY_BY_THUNDER = {
    "requires_grad": "reference True, cudagraphex False",
    "is_leaf": "reference False, cudagraphex True",  # a view of a leaf made under no_grad requires grad
}


def moved_write(failure: Failure, backend: BackendSpec, ex: CUDAGraphExecutor) -> str:
    """Why cudagraphex differs from plain Thunder by a write that plain Thunder moved into its backward; empty for no
    verdict. For an output that plain Thunder connects to autograd and cudagraphex does not,
    :func:`a_fusion_executor_agrees` or :func:`_thunders_backward_has_no_gradient`; for a whole step's loss or input
    write, :data:`_MISSED_BY_A_WHOLE_STEP` where :func:`a_fusion_executor_agrees`, or
    :func:`_written_by_thunders_backward`; for an input written by a call, :func:`_written_after_the_call`."""
    if _connected_only_by_thunder(failure):
        if a_fusion_executor_agrees(failure, backend, ex):
            return f"{_NO_GRADIENT}; Thunder with its torch.compile fusion executor does not connect it either"
        if _thunders_backward_has_no_gradient(failure, backend):
            return f"{_NO_GRADIENT}; plain Thunder's backward trace for this call returns no gradient"
    if failure.program.whole_step:
        missed = _MISSED_BY_A_WHOLE_STEP.get("loss" if failure.label == "loss" else failure.symptom)
        if missed and a_fusion_executor_agrees(failure, backend, ex, mode="close"):
            return missed
        if _written_by_thunders_backward(failure, backend, ex):
            return _WRITTEN_BY_THUNDERS_BACKWARD
    elif _written_after_the_call(failure, backend, ex):
        return _WRITTEN_AFTER_THE_CALL
    return ""


def cotangents_of_an_unwritten_output(failure: Failure, backend: BackendSpec, ex: CUDAGraphExecutor) -> str:
    """Why a whole step differs, where plain Thunder moves an in-place write of the forward into its backward; empty
    for no verdict.

    A whole step makes each cotangent from its output (its cosine) between the forward and the backward; without a
    fusion executor, plain Thunder returns the output before the write and makes it in the backward, so its
    cotangents, gradients and optimizer step differ. The verdict needs the failing step's forward alone to give what
    eager gives with cudagraphex and something else with plain Thunder, and both Thunder paths to agree up to the
    failing step with cotangents of ones on all but the loss, which sums the outputs as they are returned.
    """
    program = failure.program
    steps = program.steps[: failure.step + 1]
    if not program.whole_step or failure.label == "exception" or steps[-1].action != "call" or steps[-1].loss == "none":
        return ""
    forward_only = [*steps[:-1], dataclasses.replace(steps[-1], loss="none")]
    ones = dataclasses.replace(program, cotangents="ones")
    try:
        tags = {"eager": "eager", None: "plain Thunder", ex: "cudagraphex"}
        worlds = [World(program, backend, w, compile_source(program, tag)) for w, tag in tags.items()]
        thunder_ones = World(ones, backend, None, compile_source(ones, "plain Thunder, cotangents of ones"))
        cgx_ones = World(ones, backend, ex, compile_source(ones, "cudagraphex, cotangents of ones"))
    except Exception:  # noqa: BLE001 - no verdict
        return ""
    for index, observed in lockstep(program, worlds, forward_only, seeded=not program.threads):
        if any(o.raised is not None for o in observed):
            return ""
    eager, plain, cgx = (_outputs(o) for o in observed)
    if compare_step(program, backend, index, eager, cgx) or not compare_step(program, backend, index, plain, cgx):
        return ""
    if not run_alike(program, backend, (thunder_ones, cgx_ones), steps, seeded=not program.threads, leave_out=["loss"]):
        return ""
    return (
        "plain Thunder moves an in-place write of the forward into its backward, so a whole step makes its cotangents"
        " from outputs that miss it, where eager and cudagraphex have it; with cotangents of ones both Thunder paths"
        " agree (but on a loss summed from those outputs)"
    )


def _outputs(observed: Observations) -> Observations:
    """The outputs among ``observed``."""
    outputs = Observations()
    outputs.items = [(label, value) for label, value in observed.items if label.startswith("out")]
    return outputs


def a_fusion_executor_agrees(failure: Failure, backend: BackendSpec, ex: CUDAGraphExecutor, mode: str = "meta") -> bool:
    """Whether Thunder with its torch.compile fusion executor in cudagraphex's place observes what cudagraphex does at
    the failing step (``mode``: as ``compare_value`` compares).

    Thunder 0.2.6 returns outputs that require grad only when ``split_into_forward_and_backward`` leaves a backward
    trace: its grad transform produces no gradient under ``no_grad``, or where an in-place write may reach an input
    through ``contiguous`` (``x.t().contiguous().t().relu_()``), yet without a fusion executor the split moves that
    write into the backward, and the outputs require grad (a backward that computes nothing, or fails). A fusion
    executor fuses the write with forward outputs, so it stays in the forward and no backward is left.
    """
    from thunder.executors.torch_compile import torch_compile_ex

    steps = failure.program.steps[: failure.step + 1]
    return _witness_agrees(failure, backend, ex, (torch_compile_ex, "torch.compile fusion"), steps, mode)


def _witness_agrees(
    failure: Failure, backend: BackendSpec, ex: CUDAGraphExecutor, witness: tuple[Any, str], steps: list, mode: str
) -> bool:
    """Whether Thunder with the executor of ``witness`` (executor, tag; None: plain Thunder), running ``steps``,
    observes at the failing step what cudagraphex does running the program's steps; neither may raise before. Before
    the failing step cudagraphex agreed with plain Thunder."""
    program = failure.program
    try:
        other = World(program, backend, witness[0], compile_source(program, witness[1]))
        cgx = World(program, backend, ex, compile_source(program, "cudagraphex"))
    except Exception:  # noqa: BLE001 - no verdict
        return False
    # One world at a time: lockstep seeds each step alike whatever runs beside it.
    runs = [(other, steps), (cgx, program.steps[: failure.step + 1])]
    seen = [[o for _, (o,) in lockstep(program, (w,), s, seeded=not program.threads)] for w, s in runs]
    if any(o.raised is not None for o in (*seen[0], *seen[1])):
        return False
    return observed_alike(failure, seen[0][-1], seen[1][-1], mode)


def _written_by_thunders_backward(failure: Failure, backend: BackendSpec, ex: CUDAGraphExecutor) -> bool:
    """Whether plain Thunder, given a backward at the failing step, writes the input as cudagraphex does without one:
    the witness of a moved write where Thunder's torch.compile fusion executor gives none (Inductor refuses some
    writes into views of inputs). Also for an output: the backward writes no output Thunder made, so only an output
    that shares memory with the written input can come out as cudagraphex's by it."""
    step = failure.program.steps[failure.step]
    symptoms = (_INPUT_WRITTEN, "outN: values")
    if failure.symptom not in symptoms or step.loss != "none" or not step.mode.grad:
        return False
    steps = [*failure.program.steps[: failure.step], dataclasses.replace(step, loss="now")]
    return _witness_agrees(failure, backend, ex, (None, "reference, with a backward"), steps, "close")


def _written_after_the_call(failure: Failure, backend: BackendSpec, ex: CUDAGraphExecutor) -> bool:
    """Whether a call under grad that plain Thunder returns from before writing an input (it runs the write in its
    backward, which the call's loss starts after the input is observed, or never) writes it as Thunder with its
    torch.compile fusion executor does, where eager refuses that call (a write into a view of a leaf that requires
    grad, say) and so gives no verdict: eager runs every step before it."""
    program = failure.program
    step = program.steps[failure.step]
    if failure.symptom != _INPUT_WRITTEN or step.action != "call" or not step.mode.grad:
        return False
    try:
        eager = World(program, backend, "eager", compile_source(program, "eager"))
    except Exception:  # noqa: BLE001 - no verdict
        return False
    if raised_first_at_the_last(program, eager, program.steps[: failure.step + 1]) is None:
        return False
    return a_fusion_executor_agrees(failure, backend, ex, mode="close")


def _connected_only_by_thunder(failure: Failure) -> bool:
    return any(
        failure.symptom.endswith(f": {key}") and detail in failure.detail
        for key, detail in _CONNECTED_ONLY_BY_THUNDER.items()
    )


def _thunders_backward_has_no_gradient(failure: Failure, backend: BackendSpec) -> bool:
    """Whether plain Thunder connected an output to autograd where cudagraphex did not, and plain Thunder compiled the
    failing call with a backward trace that returns no gradient: the cause :func:`a_fusion_executor_agrees` shows,
    seen directly, for programs that Thunder's torch.compile fusion executor cannot compile. Plain Thunder may raise
    at the failing step (running such a backward, it can fail an assertion), not before it."""
    program = failure.program
    try:
        ref = World(program, backend, None, compile_source(program, "reference"))
    except Exception:  # noqa: BLE001 - no verdict
        return False
    misses = 0
    for index, (r,) in lockstep(program, (ref,), program.steps[: failure.step + 1], seeded=not program.threads):
        if r.raised is not None and index < failure.step:
            return False
        if index == failure.step:
            traces = thunder.last_backward_traces(ref.fn)
            compiled = thunder.cache_misses(ref.fn) > misses
            return (
                compiled
                and bool(traces)
                and not any(isinstance(o, TensorProxy) for o in tree_flatten(traces[-1].output)[0])
            )
        misses = thunder.cache_misses(ref.fn)
    return False
