"""Differential fuzzing: random programs and call patterns, compiled with cudagraphex and with plain Thunder.

See :mod:`tests.fuzzing`. A failure prints each failing seed with its program and call pattern; reproduce one with
``python -m tests.fuzzing --seed SEED`` (add ``--shrink`` for a smaller program with the same symptom). Differences
where plain Thunder is the one that departs from eager PyTorch, and cudagraphex agrees with eager, are listed but not
counted; so are outputs left out of autograd (requires_grad, is_leaf) as they are with Thunder's own torch.compile
fusion executor, or where plain Thunder's backward for the call returns no gradient, and backwards that plain Thunder
refuses for an input written after the forward where cudagraphex's gradients do not depend on the write, writes into a
view of a leaf that requires grad, which eager refuses and cudagraphex runs as eager runs them through ``.detach()``,
whole steps whose cotangents plain Thunder makes from outputs it writes only in its backward, whole steps whose loss
or input write plain Thunder misses where Thunder's torch.compile fusion executor agrees with cudagraphex, backwards
that cudagraphex refuses for a written input that Thunder's rematerialization saves (both agree with it turned off),
gradients of backwards that eager refuses where cudagraphex gives an in-place op's own gradient the value before the
write (both agree without that copy), values within a tolerance where cudagraphex is as close to eager as plain
Thunder, writes into outputs that Thunder's autograd function returns as views, refused as without a fusion
executor, values that Thunder's fusion executor changes where cudagraphex, with it, computes what Thunder computes
without it, and whole steps whose input write plain Thunder makes only in a backward that the step does not run,
where it makes it as cudagraphex does once the step runs one, and calls that eager refuses whose input write plain
Thunder makes only in its backward, where Thunder's torch.compile fusion executor makes it in the forward as
cudagraphex does.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from tests.fuzzing import Line, Mode, Program, Step, TensorSpec, check, run_batch
from tests.fuzzing.compare import Failure, compare_step
from tests.fuzzing.fusion_executor import fuser_departs
from tests.fuzzing.out_of_place import made_out_of_place, writes_made_out_of_place
from tests.fuzzing.side_by_side import side_by_side
from tests.fuzzing.world import BACKENDS, Observations, executor

#: Each program is compiled with and without cudagraphex, once per input signature, grad mode, train/eval mode and
#: autocast it is called in; most programs use one or two of them, and each runs 3-5 calls in every one.
CI_PROGRAMS = 300
CUDA_PROGRAMS = 100
WHOLE_STEP_PROGRAMS = 150
BUCKETED_PROGRAMS = 120


#: An input that requires grad and a parameter, the tensors of several hand-written module programs below.
_X0_AND_W0 = (
    TensorSpec("x0", "BD", "x", requires_grad=True),
    TensorSpec("w0", "DD", "param", requires_grad=True, init="torch.randn(d, d) / d**0.5"),
)


def _program(**fields) -> Program:
    """A hand-written :class:`Program`: seed 0, a function (not a module), width 4, one batch of 2, cudagraphex first,
    regions of one symbol, unless ``fields`` say otherwise."""
    defaults = {"seed": 0, "module": False, "width": 4, "batches": (2,), "position": "first", "min_region_size": 1}
    return Program(**(defaults | fields))


def _report(result, limit: int = 12) -> str:
    failures = result.counted
    shown = "\n\n".join(f.report() for f in failures[:limit])
    more = f"\n\n... and {len(failures) - limit} more" if len(failures) > limit else ""
    return f"{result.summary()}\n\n{shown}{more}"


def test_fuzz_cpu_replay_backend():
    """300 programs (seeds 0-299) on the CPU replay backend, compared exactly with plain Thunder, in two forked
    processes where two cores are available. Measured on the 2-core CI machine: 62 s when nothing fails (1,548 calls,
    786 Thunder compilations of 0.13-0.22 s each, which are the cost), 74-83 s with 8 failing programs (a failure is
    run again beside eager PyTorch)."""
    result = run_batch(range(CI_PROGRAMS), "emulate", workers=min(2, os.cpu_count() or 1))
    assert result.programs == CI_PROGRAMS
    if result.counted:
        pytest.fail(_report(result), pytrace=False)


def test_fuzz_whole_step_cpu_replay_backend():
    """150 programs (seeds 0-149) with each call made one whole step, forward and backward, through ``graph_step``
    (``Program.as_whole_steps``), compared exactly with the same steps run by plain Thunder. About 20 s on two cores."""
    result = run_batch(range(WHOLE_STEP_PROGRAMS), "emulate", workers=min(2, os.cpu_count() or 1), steps="whole")
    assert result.programs == WHOLE_STEP_PROGRAMS
    assert result.step_replays > 0, result.summary()
    if result.counted:
        pytest.fail(_report(result), pytrace=False)


def test_fuzz_whole_step_with_thunders_torch_compile_executor():
    """Whole steps of seeds 0-4 and 131 with Thunder's torch.compile executor in both compiled functions
    (``Program.fuser``; seed 131 writes a parameter inside its fusion), the configuration README recommends without
    nvFuser. Inductor compiles for seconds per program on the CPU, so the batch is small; and in one process, since a
    process forked after Inductor has compiled (earlier tests) can hang in its compile workers."""
    seeds = [*range(5), 131]
    result = run_batch(seeds, "emulate", steps="whole", fuser=True)
    assert result.programs == len(seeds)
    if result.counted:
        pytest.fail(_report(result), pytrace=False)


def test_fuzz_bucketed_cpu_replay_backend():
    """120 programs (seeds 0-119) as serving steps with batch-size buckets (``Program.as_bucketed_steps``): calls of
    the smaller batch replay the larger batch's graph padded where the row check allows it, compared within a
    tolerance with the same steps run by plain Thunder (padding changes the batch a matrix product sees). Programs
    with an input that does not carry the batch along dim 0 are skipped. About 25 s on two cores."""
    result = run_batch(range(BUCKETED_PROGRAMS), "emulate", workers=min(2, os.cpu_count() or 1), steps="bucketed")
    assert result.programs == BUCKETED_PROGRAMS
    assert result.padded_calls > 0, result.summary()
    if result.counted:
        pytest.fail(_report(result), pytrace=False)


@pytest.mark.cuda
def test_fuzz_cuda():
    """100 programs on real CUDA graphs (larger tensors): RNG-free programs compared within a tolerance, programs
    with random ops statistically (zero fraction, mean and spread, and fresh draws on every call)."""
    result = run_batch(range(10_000, 10_000 + CUDA_PROGRAMS), "cuda")
    assert result.programs == CUDA_PROGRAMS
    if result.counted:
        pytest.fail(_report(result), pytrace=False)


@pytest.mark.cuda
def test_fuzz_cuda_in_worker_processes():
    """``workers`` on CUDA: processes started anew (a forked one cannot use the parent's CUDA context), each with a
    context of its own, check the seeds and report them back."""
    result = run_batch(range(10_000, 10_004), "cuda", workers=2)
    assert result.programs == 4 and not result.unchecked
    if result.counted:
        pytest.fail(_report(result), pytrace=False)


@pytest.mark.cuda
def test_fuzz_whole_step_cuda():
    """50 programs as whole steps through ``graph_step`` on real CUDA graphs, compared as ``test_fuzz_cuda`` compares."""
    result = run_batch(range(10_000, 10_000 + WHOLE_STEP_PROGRAMS // 3), "cuda", steps="whole")
    assert result.programs == WHOLE_STEP_PROGRAMS // 3
    assert result.step_replays > 0, result.summary()
    if result.counted:
        pytest.fail(_report(result), pytrace=False)


@pytest.mark.cuda
def test_fuzz_bucketed_cuda():
    """40 programs (seeds 0-39) as serving steps with batch-size buckets on real CUDA graphs, where Thunder's SDPA
    executor checks its kernels on fake tensors inside the row check's call."""
    result = run_batch(range(BUCKETED_PROGRAMS // 3), "cuda", steps="bucketed")
    assert result.programs == BUCKETED_PROGRAMS // 3
    assert result.padded_calls > 0, result.summary()
    if result.counted:
        pytest.fail(_report(result), pytrace=False)


@pytest.mark.parametrize("workers", [1, 2])
def test_seeds_whose_turn_comes_after_the_deadline_are_not_checked(workers):
    """A batch with a deadline checks the seeds whose turn comes before it and reports the rest, in one process and in
    forked ones; without one it checks every seed."""
    past = run_batch(range(3), "emulate", workers=workers, deadline_s=0.0)
    assert (past.programs, past.unchecked) == (0, [0, 1, 2])
    assert "deadline reached: 3 seeds not checked, from 0" in past.summary()
    result = run_batch(range(2), "emulate", workers=workers, deadline_s=600.0)
    assert (result.programs, result.unchecked) == (2, [])
    assert "deadline" not in result.summary()


@pytest.mark.cuda
def test_a_saved_tensor_of_an_eager_forward_in_recycled_memory_with_other_strides_is_not_replayed_over():
    """The backward region reads the forward's mask ``x0 > 0`` as a static input. Its graph is captured on the first
    call's second backward; the second call, on a transposed ``x0``, runs the forward eagerly (a new signature), and
    the caching allocator puts its mask, transposed, where the first call's was. Replaying the graph there read the
    new mask in the old layout (wrong gradients of ``x0``)."""
    program = _program(
        module=True,
        width=6,
        batches=(2, 4),
        min_region_size=2,
        tensors=list(_X0_AND_W0),
        lines=[Line("v1 = torch.relu(x0)", "v1", frozenset({"x0"}), False, "unary")],
        outputs=["v1", "self.w0.t()"],
        steps=[
            Step("call", Mode(), loss="retain"),
            Step("call", Mode(), layout="transposed", fresh=False, keep="hold", loss="now"),
        ],
    )
    outcome = check(program, "cuda")
    assert not outcome.failures, [f.report() for f in outcome.failures]


def test_requires_grad_that_thunder_loses_with_any_fusion_executor_is_excused():
    """Thunder's grad transform finds no gradient through the in-place write into ``x0.t().contiguous().t()``; plain
    Thunder's output requires grad only because Thunder moves that write into its backward. With its torch.compile
    fusion executor the output loses requires_grad as with cudagraphex: excused, though eager disagrees."""
    lines = [
        Line("v0 = x0.t().contiguous().t()", "v0", frozenset({"x0"}), False, "view"),
        Line("v1 = v0 * 2", "v1", frozenset({"v0"}), False, "binary"),
        Line("v0.relu_()", None, frozenset({"v0"}), True, "inplace_intermediate"),
    ]
    program = _program(
        tensors=[TensorSpec("x0", "BD", "x", requires_grad=True)],
        lines=lines,
        outputs=["v1"],
        steps=[Step("call", Mode())],
    )
    (failure,) = check(program).failures
    assert failure.symptom == "outN: requires_grad"
    assert "fusion executor" in failure.excused


def test_requires_grad_under_no_grad_that_only_an_empty_thunder_backward_gives_is_excused():
    """Plain Thunder moves ``v0.copy_(x0)`` into a backward that returns no gradient, and so connects the outputs of a
    call under ``no_grad`` to autograd. Eager refuses an earlier backward (through the buffer's history across
    calls), and Thunder's torch.compile fusion executor cannot compile the buffer write, so neither can judge; plain
    Thunder's backward trace for the call shows the cause: excused."""
    lines = [
        Line("v0 = torch.sigmoid(x1)", "v0", frozenset({"x1"}), False, "unary"),
        Line("v0.copy_(x0)", None, frozenset({"x0", "v0"}), True, "inplace_intermediate"),
        Line("self.m0[i0] = x1", None, frozenset({"self.m0", "i0", "x1"}), True, "index_copy"),
        Line("v1 = self.m0[: x1.shape[0]] * 2", "v1", frozenset({"x1", "self.m0"}), False, "readback"),
    ]
    grad_call = Step("call", Mode(), loss="retain", form="direct")
    program = _program(
        module=True,
        batches=(4,),
        tensors=[
            TensorSpec("x0", "BD", "x"),
            TensorSpec("x1", "BD", "x", requires_grad=True),
            TensorSpec("m0", "ND", "buffer", init="torch.zeros(n, d)"),
            TensorSpec("i0", "I", "index"),
        ],
        lines=lines,
        outputs=["v1"],
        steps=[grad_call, grad_call, Step("call", Mode(grad=False))],
        min_region_size=2,
    )
    (failure,) = check(program).failures
    assert failure.step == 2 and failure.symptom == "outN: requires_grad"
    assert "backward trace for this call returns no gradient" in failure.excused


def test_requires_grad_that_only_a_failing_empty_thunder_backward_gives_is_excused():
    """``contiguous`` copies the transposed ``x0``; Thunder's grad transform finds no gradient for ``v0.sub_(...)``,
    and plain Thunder connects ``v0`` to autograd through a backward that returns none and fails an assertion when the
    call's loss runs it. That backward trace shows the cause though plain Thunder raises at the step: excused."""
    lines = [
        Line("v0 = x0.transpose(0, 1).contiguous().transpose(0, 1)", "v0", frozenset({"x0"}), False, "view"),
        Line("s0[0].add_(1)", None, frozenset({"s0"}), True, "write_input"),
        Line("v0.sub_(x0.detach())", None, frozenset({"v0", "x0"}), True, "inplace_intermediate"),
    ]
    program = _program(
        batches=(3,),
        tensors=[TensorSpec("x0", "BD", "x", requires_grad=True), TensorSpec("s0", "D", "state")],
        lines=lines,
        outputs=["v0"],
        steps=[Step("call", Mode(), loss="retain")],
        position="last",
        min_region_size=2,
    )
    (failure,) = check(program).failures
    assert failure.step == 0 and failure.symptom == "outN: requires_grad"
    assert "backward trace for this call returns no gradient" in failure.excused


def test_a_view_of_a_parameter_that_only_an_empty_thunder_backward_connects_is_excused():
    """Thunder's grad transform finds no gradient for ``self.w0[0]`` after ``self.w0.mul_(0.99)`` under ``no_grad``
    (eager has one). Plain Thunder connects the output only because it moves the dead write into ``x0``'s alias into a
    backward that returns no gradient; cudagraphex keeps that write in the forward, so no backward is left and the
    output is the view eager makes under ``no_grad``, a leaf that requires grad: excused."""
    lines = [
        Line("with torch.no_grad():\n    self.w0.mul_(0.99)", None, frozenset({"self.w0"}), True, "param_write"),
        Line("v0 = x0.detach()", "v0", frozenset({"x0"}), False, "detach"),
        Line("v0.mul_(0.9).add_(v0.detach())", None, frozenset({"v0"}), True, "write_input"),
    ]
    program = _program(
        module=True,
        tensors=list(_X0_AND_W0),
        lines=lines,
        outputs=["self.w0[0]"],
        steps=[Step("call", Mode())],
        position="last",
    )
    (failure,) = check(program).failures
    assert failure.symptom == "outN: is_leaf"
    assert failure.excused.startswith("Thunder's grad transform finds no gradient")


def test_calls_under_autocast_are_compiled_and_compared_apart():
    """A call under ``torch.autocast`` to bfloat16 is its own Thunder cache entry, in both compiled functions: two
    signatures, two compilations each, and both paths agree on every step."""
    lines = [
        Line("v0 = F.linear(x0, self.w0, self.p0)", "v0", frozenset({"x0", "self.w0", "self.p0"}), False, "linear")
    ]
    program = _program(
        module=True,
        tensors=[
            TensorSpec("x0", "BD", "x"),
            TensorSpec("w0", "DD", "param", requires_grad=True, init="torch.randn(d, d) / d**0.5"),
            TensorSpec("p0", "D", "param", requires_grad=True, init="torch.randn(d) * 0.5"),
        ],
        lines=lines,
        outputs=["v0"],
        steps=[Step("call", Mode(), loss="now"), Step("call", Mode(autocast=True), loss="now")],
    )
    outcome = check(program)
    assert not outcome.failures and not outcome.raised_in_both
    assert outcome.compilations == 4


def test_a_forward_after_a_backward_that_eager_refuses_is_judged_by_eager():
    """``v0[:, 0].mul_(2)`` writes relu's saved output in place: eager refuses the backward, which Thunder computes.
    Plain Thunder drops the write from its forward's output; cudagraphex keeps it, as eager does at the next call,
    which eager runs past its refused backward: excused. (Seed 10 draws a first input whose first column is negative,
    so that the difference shows only after the refused backward.)"""
    lines = [
        Line("v0 = torch.relu(x0)", "v0", frozenset({"x0"}), False, "unary"),
        Line("v0[:, 0].mul_(2)", None, frozenset({"v0"}), True, "inplace_intermediate"),
    ]
    program = _program(
        seed=10,
        tensors=[TensorSpec("x0", "BD", "x", requires_grad=True)],
        lines=lines,
        outputs=["v0"],
        steps=[Step("call", Mode(), loss="now"), Step("call", Mode())],
    )
    (failure,) = check(program).failures
    assert failure.step == 1 and failure.symptom == "outN: values"
    assert "eager refused an earlier backward" in failure.excused


def test_a_whole_step_after_one_whose_backward_eager_refuses_is_judged_by_eager():
    """``x1[0].add_(1)`` writes the input that ``F.linear`` saves for ``w0``'s gradient: eager refuses the first
    step's backward, which Thunder computes. Plain Thunder moves the write into its backward, so the second step,
    without a backward, leaves ``x1`` unwritten; cudagraphex writes it, as eager does at that step, which eager runs
    past its refused backward (no optimizer step is skipped): excused."""
    lines = [
        Line("v0 = F.linear(x1, self.w0, self.p0)", "v0", frozenset({"x1", "self.w0", "self.p0"}), False, "linear"),
        Line("x1[0].add_(1)", None, frozenset({"x1"}), True, "write_input"),
    ]
    program = _program(
        width=6,
        batches=(4,),
        tensors=[
            TensorSpec("x1", "BD", "state"),
            TensorSpec("w0", "DD", "param", requires_grad=True, init="torch.randn(d, d) / d**0.5"),
            TensorSpec("p0", "D", "param", init="torch.randn(d) * 0.5"),
        ],
        lines=lines,
        outputs=["v0"],
        steps=[Step("call", Mode(), loss="now", form="direct"), Step("call", Mode())],
        position="last",
        whole_step=True,
        optimizer="none",
    )
    (failure,) = check(program).failures
    assert failure.step == 1 and failure.symptom == "input NAME after the call: values"
    assert "eager refused an earlier backward" in failure.excused


def test_a_whole_step_input_write_that_only_plain_thunder_misses_is_judged_by_a_fusion_executor():
    """As above, with SGD with momentum: eager's refused backward also skips the optimizer's step, so eager cannot
    judge the second step, run under ``no_grad``, where plain Thunder misses the write it moved into its backward.
    Thunder with its torch.compile fusion executor writes ``x0`` as cudagraphex does: excused."""
    lines = [
        Line("v0 = F.linear(x0, self.w0, self.p0)", "v0", frozenset({"x0", "self.w0", "self.p0"}), False, "linear"),
        Line("x0[0].add_(1)", None, frozenset({"x0"}), True, "write_input"),
    ]
    program = _program(
        module=True,
        batches=(4,),
        tensors=[
            TensorSpec("x0", "BD", "state"),
            TensorSpec("w0", "DD", "param", requires_grad=True, init="torch.randn(d, d) / d**0.5"),
            TensorSpec("p0", "D", "param", requires_grad=True, init="torch.randn(d) * 0.5"),
        ],
        lines=lines,
        outputs=["v0"],
        steps=[Step("call", Mode(), loss="now", form="direct"), Step("call", Mode(grad=False))],
        position="last",
        whole_step=True,
        optimizer="momentum",
    )
    (failure,) = check(program).failures
    assert failure.step == 1 and failure.symptom == "input NAME after the call: values"
    assert "torch.compile fusion executor writes the input as cudagraphex does" in failure.excused


def test_a_write_that_only_plain_thunders_backward_reads_is_excused():
    """Plain Thunder moves ``v0.relu_()`` into its backward, which then saves ``x1`` and refuses the backward after
    ``x1`` is written; cudagraphex keeps the write in the forward and saves no ``x1``. Eager refuses an earlier
    backward (through ``c0``'s history across calls, which the backward before freed), so it cannot judge; the
    program without the write can: excused."""
    lines = [
        Line("v0 = torch.tanh(x1)", "v0", frozenset({"x1"}), False, "unary"),
        Line("v0.relu_()", None, frozenset({"v0"}), True, "inplace_intermediate"),
        Line("c0.index_copy_(0, i0, x1)", None, frozenset({"c0", "i0", "x1"}), True, "index_copy"),
        Line("v1 = c0.sum(0)", "v1", frozenset({"c0"}), False, "readback"),
    ]
    steps = [
        Step("call", Mode(), loss="pending", form="direct"),
        Step("call", Mode(), loss="now"),
        Step("backward", target="first"),
        Step("call", Mode(), fresh=False, loss="pending"),
        Step("write_input", target="x1", variant=1),
        Step("backward", target="last"),
    ]
    program = _program(
        width=6,
        batches=(3,),
        tensors=[
            TensorSpec("x1", "BD", "x", requires_grad=True),
            TensorSpec("c0", "ND", "state", persistent=True),
            TensorSpec("i0", "I", "index"),
        ],
        lines=lines,
        outputs=["v1"],
        steps=steps,
    )
    (failure,) = check(program).failures
    assert failure.step == 5 and failure.symptom.startswith("raises only without cudagraphex")
    assert "its backward read no written tensor" in failure.excused


def test_an_output_that_only_thunder_marks_as_requiring_grad_leaves_the_other_cotangents_as_eager_draws_them():
    """Thunder returns ``v1``, which reads no input that requires grad, as requiring grad; eager does not. Plain Thunder
    computes the gradient of ``v0.mul_(x1)`` from ``v0`` after the write. Eager gives ``v0`` the cotangent the
    Thunder paths give it, so it can judge the gradient of ``x1``: cudagraphex agrees with it, excused."""
    lines = [
        Line("v0 = torch.softmax(x1 @ x1.t(), -1) @ x0", "v0", frozenset({"x0", "x1"}), False, "attention"),
        Line("v1 = c0.sum(0)", "v1", frozenset({"c0"}), False, "readback"),
        Line("v0.mul_(x1)", None, frozenset({"v0", "x1"}), True, "inplace_intermediate"),
    ]
    program = _program(
        module=True,
        batches=(4,),
        tensors=[
            TensorSpec("x0", "BD", "x"),
            TensorSpec("x1", "BD", "x", requires_grad=True),
            TensorSpec("c0", "ND", "state", persistent=True),
        ],
        lines=lines,
        outputs=["v1", "v0"],
        steps=[Step("call", Mode(), loss="now")],
    )
    (failure,) = check(program).failures
    assert failure.symptom == "grad of cN NAME: values"
    assert "cudagraphex agrees with eager" in failure.excused


def _tanh_written_in_place(*lines: Line) -> Program:
    """``v0 = tanh(x1)`` (which saves its result for backward), ``lines``, ``v0.relu_()``, ``v1 = v0 @ x0.t()``."""
    return _program(
        module=True,
        tensors=[TensorSpec("x0", "BD", "x"), TensorSpec("x1", "BD", "x", requires_grad=True)],
        lines=[
            Line("v0 = torch.tanh(x1)", "v0", frozenset({"x1"}), False, "unary"),
            *lines,
            Line("v0.relu_()", None, frozenset({"v0"}), True, "inplace_intermediate"),
            Line("v1 = v0 @ x0.t()", "v1", frozenset({"v0", "x0"}), False, "matmul"),
        ],
        outputs=["v1"],
        steps=[Step("call", Mode(), loss="now")],
    )


def test_a_gradient_where_eager_refuses_a_write_into_an_intermediate_is_judged_with_the_write_made_out_of_place():
    """Eager refuses the backward (``relu_`` writes the result ``tanh`` saved); written ``v0 = v0.relu()`` it runs,
    and gives cudagraphex's gradient of ``x1``. Where a view of ``v0`` could see the write, there is no such form."""
    program = _tanh_written_in_place()
    failure = Failure(0, 0, "grad of c0 x1", "", "grad of cN NAME: values", program)
    assert "made out of place" in writes_made_out_of_place(failure, BACKENDS["emulate"], executor("emulate", 1))
    assert "v0 = v0.relu()" in made_out_of_place(program).source()
    viewed = _tanh_written_in_place(Line("v2 = v0.t().t()", "v2", frozenset({"v0"}), False, "view"))
    assert made_out_of_place(viewed) is None
    other = Failure(0, 0, "grad of c0 x1", "", "grad of cN NAME: values", viewed)
    assert writes_made_out_of_place(other, BACKENDS["emulate"], executor("emulate", 1)) == ""


def test_an_error_only_plain_thunder_raises_where_eager_refuses_a_write_into_an_intermediate_is_judged_out_of_place():
    """Where plain Thunder raises at the step whose backward eager refuses, and cudagraphex runs it, every value the step
    observes is judged by eager with the write made out of place: here it agrees. A program whose written tensor a view
    could see has no such form; an error that only cudagraphex raises gets no verdict."""
    emulate, ex = BACKENDS["emulate"], executor("emulate", 1)
    symptom = "raises only without cudagraphex: Unsupported: failed to find name in frame builtins"
    failure = Failure(0, 0, "exception", "", symptom, _tanh_written_in_place())
    assert "observes the values eager observes" in writes_made_out_of_place(failure, emulate, ex)
    viewed = _tanh_written_in_place(Line("v2 = v0.t().t()", "v2", frozenset({"v0"}), False, "view"))
    assert writes_made_out_of_place(dataclasses.replace(failure, program=viewed), emulate, ex) == ""
    only_with = dataclasses.replace(failure, symptom="raises only with cudagraphex: RuntimeError: N")
    assert writes_made_out_of_place(only_with, emulate, ex) == ""


def test_side_by_side_shows_each_world_step_by_step():
    """``--side-by-side``: a row per value plain Thunder observes, a column per other world, what each world raised;
    here eager refuses the backward and eager with the write made out of place gives cudagraphex's gradient, to the
    rounding of its own kernels."""
    lines: list[str] = []
    side_by_side(_tanh_written_in_place(), "emulate", out=lines.append)
    assert lines[0] == "columns: [1] cudagraphex; [2] eager; [3] eager, writes out of place"
    assert lines[1].startswith("step 0: call")
    assert any(line.startswith("  eager raises RuntimeError: one of the variables needed") for line in lines)
    (row,) = [line for line in lines if line.lstrip().startswith("grad of c0 x1")]
    cudagraphex, eager, out_of_place = (cell.split()[0] for cell in row.split("]")[1:])
    assert (cudagraphex, eager) == ("0", "-") and float(out_of_place) < 1e-6, row
    with pytest.raises(ValueError, match="one thread"):
        side_by_side(dataclasses.replace(_tanh_written_in_place(), threads=True), "emulate")


def test_a_write_into_a_view_of_a_leaf_that_requires_grad_is_excused_where_eager_through_detach_agrees():
    """Eager refuses ``v0.mul_(2)`` into a view of the leaf ``x0``; Thunder checks only the write's target, here a
    view of the transposed input, so neither Thunder path refuses it. Plain Thunder drops the write; cudagraphex
    writes ``x0`` as eager does with the write made through ``.detach()``: excused."""
    lines = [
        Line("v0 = x0.t().t()", "v0", frozenset({"x0"}), False, "view"),
        Line("v1 = v0.abs().sqrt()", "v1", frozenset({"v0"}), False, "unary"),
        Line("v0.mul_(2)", None, frozenset({"v0"}), True, "write_grad_leaf"),
        Line("v2 = v1 @ self.w0.t()", "v2", frozenset({"v1", "self.w0"}), False, "matmul"),
    ]
    program = _program(
        module=True,
        tensors=list(_X0_AND_W0),
        lines=lines,
        outputs=["v2"],
        steps=[Step("call", Mode(), layout="transposed")],
    )
    (failure,) = check(program).failures
    assert failure.symptom == "input NAME after the call: values"
    assert "made through .detach()" in failure.excused


def test_an_input_write_that_plain_thunder_moves_into_its_backward_is_judged_by_a_fusion_executor():
    """Eager refuses ``v0.mul_(2)`` into a view of the leaf ``x0``. Plain Thunder runs the write in its backward, so
    ``x0`` is unwritten after the call (the backward starts only after the inputs are observed); it gives ``x0`` no
    gradient, as cudagraphex does, so eager with the write made through ``.detach()``, which gives one, is no witness.
    cudagraphex writes ``x0`` in the forward, as Thunder with its torch.compile fusion executor does: excused."""
    lines = [
        Line("v0 = x0.unsqueeze(0)[0]", "v0", frozenset({"x0"}), False, "view"),
        Line("v1 = torch.where(v0 > 0, v0, v0)", "v1", frozenset({"v0"}), False, "binary"),
        Line("v2 = v1 @ self.w0", "v2", frozenset({"v1", "self.w0"}), False, "matmul"),
        Line("v0.mul_(2)", None, frozenset({"v0"}), True, "write_grad_leaf"),
    ]
    program = _program(
        module=True,
        tensors=list(_X0_AND_W0),
        lines=lines,
        outputs=["v2"],
        steps=[Step("call", Mode(), layout="transposed", loss="now", form="direct")],
    )
    (failure,) = check(program).failures
    assert failure.step == 0 and failure.symptom == "input NAME after the call: values"
    assert "Thunder with its torch.compile fusion executor writes the input in the forward" in failure.excused


def test_a_write_through_contiguous_into_a_leaf_that_requires_grad_is_excused_where_eager_through_detach_agrees():
    """For a transposed ``x0``, ``x0.transpose(0, 1).contiguous()`` returns ``x0.t()`` itself, so eager refuses
    ``v0.add_(v0)`` into a view of the leaf ``x0``. Thunder takes the result of ``contiguous`` for a new tensor: plain
    Thunder drops the write, cudagraphex writes ``x0`` as eager does with the write made through ``.detach()``:
    excused."""
    lines = [
        Line("v0 = x0.transpose(0, 1).contiguous().transpose(0, 1)", "v0", frozenset({"x0"}), False, "view"),
        Line("v0.add_(v0)", None, frozenset({"v0"}), True, "inplace_intermediate"),
        Line("v1 = F.embedding(t0, self.e0)", "v1", frozenset({"t0", "self.e0"}), False, "embedding"),
    ]
    program = _program(
        module=True,
        width=6,
        batches=(3,),
        tensors=[
            TensorSpec("x0", "BD", "x", requires_grad=True),
            TensorSpec("t0", "T", "tokens"),
            TensorSpec("e0", "VD", "param", requires_grad=True, init="torch.randn(vocab, d)"),
        ],
        lines=lines,
        outputs=["v1"],
        steps=[Step("call", Mode(), layout="transposed")],
        min_region_size=2,
    )
    (failure,) = check(program).failures
    assert failure.symptom == "input NAME after the call: values"
    assert "made through .detach()" in failure.excused


def test_a_whole_step_whose_cotangents_plain_thunder_makes_before_a_forward_write_is_excused():
    """Plain Thunder moves ``v0[:, 0].mul_(2)`` into its backward, so the step makes its cotangent (the output's
    cosine) from an output without the write, and its SGD step differs; eager and cudagraphex return the output
    written, and with cotangents of ones both Thunder paths agree: excused."""
    lines = [
        Line("v0 = F.linear(x0, self.w0, self.p0)", "v0", frozenset({"x0", "self.w0", "self.p0"}), False, "linear"),
        Line("v0[:, 0].mul_(2)", None, frozenset({"v0"}), True, "inplace_intermediate"),
    ]
    program = _program(
        module=True,
        width=6,
        tensors=[
            TensorSpec("x0", "BD", "x"),
            TensorSpec("w0", "DD", "param", requires_grad=True, init="torch.randn(d, d) / d**0.5"),
            TensorSpec("p0", "D", "param", requires_grad=True, init="torch.randn(d) * 0.5"),
        ],
        lines=lines,
        outputs=["v0"],
        steps=[Step("call", Mode(), loss="now", form="direct")],
        position="last",
        whole_step=True,
        optimizer="sgd",
    )
    (failure,) = check(program).failures
    assert failure.symptom == "state NAME: values"
    assert "cotangents of ones both Thunder paths agree" in failure.excused


def test_a_whole_step_whose_loss_sums_an_output_plain_thunder_writes_only_in_its_backward_is_excused():
    """As above, with the loss summed from the outputs, one of them the parameter: the loss reads ``v0`` as each Thunder
    path returns it, so it differs with cotangents of ones too; the parameter the step returns after SGD differs
    first, and with cotangents of ones both Thunder paths agree on all but the loss: excused."""
    lines = [
        Line("v0 = x0 @ self.w0", "v0", frozenset({"x0", "self.w0"}), False, "matmul"),
        Line("v0[:, 0].mul_(2)", None, frozenset({"v0"}), True, "inplace_intermediate"),
    ]
    program = _program(
        module=True,
        tensors=[
            TensorSpec("x0", "BD", "x"),
            TensorSpec("w0", "DD", "param", requires_grad=True, init="torch.randn(d, d) / d**0.5"),
        ],
        lines=lines,
        outputs=["v0", "self.w0"],
        steps=[Step("call", Mode(), loss="now", form="sum")],
        whole_step=True,
        optimizer="momentum",
    )
    (failure,) = check(program).failures
    assert failure.label == "out1" and failure.symptom == "outN: values"
    assert "cotangents of ones both Thunder paths agree" in failure.excused


def test_a_write_into_a_view_of_a_leaf_in_a_random_program_is_judged_on_what_failed():
    """As above, in a program that draws a dropout mask, which eager draws differently from Thunder: the write made
    through ``.detach()`` gives eager's ``x0`` what cudagraphex gives it (``reshape(-1)`` of the strided ``x0`` is a
    view), and the verdict compares that observation alone: excused."""
    lines = [
        Line("v0 = F.dropout(x1, p=0.5, training=True)", "v0", frozenset({"x1"}), True, "dropout"),
        Line("v1 = x0.reshape(-1).view(x0.shape)", "v1", frozenset({"x0"}), False, "view"),
        Line("v1.mul_(2)", None, frozenset({"v1"}), True, "write_grad_leaf"),
        Line("v2 = torch.tanh(v0)", "v2", frozenset({"v0"}), False, "unary"),
    ]
    program = _program(
        batches=(4,),
        tensors=[TensorSpec("x0", "BD", "x", requires_grad=True), TensorSpec("x1", "BD", "x", requires_grad=True)],
        lines=lines,
        outputs=["v2"],
        steps=[Step("call", Mode(), layout="strided")],
        position="last",
    )
    assert program.random
    (failure,) = check(program).failures
    assert failure.symptom == "input NAME after the call: values"
    assert "made through .detach()" in failure.excused


def test_an_input_that_rematerialization_saves_in_a_larger_region_is_excused_where_it_decides_the_difference():
    """With Thunder's torch.compile executor after cudagraphex, rematerialization makes the backward recompute
    ``x1 * rand`` from ``x1``, an input of the one region, where plain Thunder's fusion returns the product to the
    matrix product's fusion and saves it. A write into ``x1`` before the backward makes autograd refuse only
    cudagraphex's backward; built with rematerialization off, both run the program alike: excused."""
    lines = [
        Line("v0 = x1 * torch.rand_like(x1)", "v0", frozenset({"x1"}), True, "random"),
        Line("v1 = x0.roll(1, 0)", "v1", frozenset({"x0"}), False, "view"),
        Line("v2 = v0 @ self.w0", "v2", frozenset({"v0", "self.w0"}), False, "matmul"),
    ]
    program = _program(
        module=True,
        batches=(4,),
        tensors=[
            TensorSpec("x0", "BD", "x"),
            TensorSpec("x1", "BD", "x", requires_grad=True),
            TensorSpec("w0", "DD", "param", requires_grad=True, init="torch.randn(d, d) / d**0.5"),
        ],
        lines=lines,
        outputs=["v2", "v1"],
        steps=[
            Step("call", Mode(), loss="pending", form="direct"),
            Step("write_input", target="x1"),
            Step("backward", target="first"),
        ],
        fuser=True,
    )
    (failure,) = check(program).failures
    assert failure.step == 2 and failure.symptom.startswith("raises only with cudagraphex")
    assert "with rematerialization off both agree" in failure.excused


def test_an_input_that_rematerialization_saves_is_excused_where_plain_thunder_fails_otherwise():
    """As above, where Thunder's grad rule for ``roll`` saves its input and rematerialization trades it for ``x0``;
    plain Thunder's backward fusion fails in Dynamo (``roll_vjp``), cudagraphex's refuses the written ``x0``. Built
    with rematerialization off, both raise Dynamo's error: excused."""
    lines = [
        Line("v0 = (x0 * 0.5 + 0.25)", "v0", frozenset({"x0"}), False, "unary"),
        Line("v1 = v0.roll(1, 0)", "v1", frozenset({"v0"}), False, "view"),
    ]
    program = _program(
        tensors=[TensorSpec("x0", "BD", "x", requires_grad=True)],
        lines=lines,
        outputs=["v1"],
        steps=[
            Step("call", Mode(), loss="pending", form="direct"),
            Step("write_input", target="x0"),
            Step("backward", target="last", retain=True),
        ],
        fuser=True,
    )
    (failure,) = check(program).failures
    assert failure.step == 2 and failure.symptom.startswith("reference raises Unsupported, cudagraphex RuntimeError")
    assert "with rematerialization off both agree" in failure.excused


@pytest.mark.parametrize("position", ["first", "last"])
def test_an_in_place_ops_own_gradient_read_before_its_write_is_excused_where_eager_refuses_the_backward(position):
    """``mul_``'s gradient for ``v1`` reads ``v0`` as it was before the write; cudagraphex gives it that value, plain
    Thunder the written one. Eager refuses the backward, as ``sqrt`` saved its result, which the write changed (Thunder
    recomputes it instead). Built without cudagraphex's copy, both run the program alike: excused."""
    lines = [
        Line("v0 = x0.abs().sqrt()", "v0", frozenset({"x0"}), False, "unary"),
        Line("v1 = torch.tanh(x0)", "v1", frozenset({"x0"}), False, "unary"),
        Line("v0.mul_(v1)", None, frozenset({"v0", "v1"}), True, "inplace_intermediate"),
    ]
    program = _program(
        batches=(4,),
        tensors=[TensorSpec("x0", "BD", "x", requires_grad=True)],
        lines=lines,
        outputs=["v0"],
        steps=[Step("call", Mode(), loss="now")],
        position=position,
    )
    (failure,) = check(program).failures
    assert failure.step == 0 and failure.symptom.startswith("grad of")
    assert "as eager's original_self" in failure.excused


def test_values_within_a_tolerance_are_excused_where_cudagraphex_is_as_close_to_eager_as_plain_thunder():
    """Both Thunder paths decompose ``layer_norm`` of a buffer written in place; they round its last bit differently,
    and neither as eager does, where cudagraphex is no further from eager than plain Thunder: excused. (The inputs are
    drawn from seed 71068, which gives such values.)"""
    lines = [
        Line("s0[0].add_(1)", None, frozenset({"s0"}), True, "write_input"),
        Line("v0 = x1 @ self.w0", "v0", frozenset({"x1", "self.w0"}), False, "matmul"),
        Line("s1.copy_(s0)", None, frozenset({"s1", "s0"}), True, "write_input"),
        Line("v1 = F.layer_norm(s1, s1.shape[-1:])", "v1", frozenset({"s1"}), False, "layer_norm"),
    ]
    program = _program(
        seed=71068,
        module=True,
        width=6,
        tensors=[
            TensorSpec("x1", "BD", "x", requires_grad=True),
            TensorSpec("s0", "BD", "state"),
            TensorSpec("s1", "BD", "state"),
            TensorSpec("w0", "DD", "param", init="torch.randn(d, d) / d**0.5"),
        ],
        lines=lines,
        outputs=["v1", "v0"],
        steps=[Step("call", Mode())],
    )
    (failure,) = check(program).failures
    assert failure.nearly_equal and failure.symptom == "outN: values (within a tolerance)"
    assert "cudagraphex is as close to eager as plain Thunder or closer" in failure.excused


def test_a_write_into_a_view_output_is_excused_where_plain_thunder_refuses_it_without_a_fusion_executor():
    """``v1 * h0`` uses a host value, so it runs outside graphs and the region after it returns views of it; Thunder's
    autograd function refuses an in-place write into such an output. Inductor returns a new tensor for the whole
    chain, so plain Thunder with its fusion executor allows the write, and without it refuses it: excused."""
    lines = [
        Line("v0 = x1.unsqueeze(0)[0]", "v0", frozenset({"x1"}), False, "view"),
        Line("h0 = v0.mean().item()", "h0", frozenset({"v0"}), False, "item"),
        Line("v1 = x1 * h0", "v1", frozenset({"x1", "h0"}), False, "item"),
        Line("v2 = v1.reshape(-1).view(v1.shape)", "v2", frozenset({"v1"}), False, "view"),
    ]
    program = _program(
        module=True,
        width=6,
        tensors=[TensorSpec("x1", "BD", "x", requires_grad=True)],
        lines=lines,
        outputs=["v2"],
        steps=[
            Step("call", Mode()),
            Step("call", Mode(), keep="hold"),
            Step("write_output", target="c1", variant=4),
        ],
        min_region_size=2,
        fuser=True,
    )
    (failure,) = check(program).failures
    assert failure.step == 2 and failure.symptom.startswith("raises only with cudagraphex")
    assert "plain Thunder without its fusion executor refuses it too" in failure.excused


def test_a_gradient_that_thunders_fusion_executor_changes_is_excused_where_cudagraphex_gives_thunders_without_it():
    """With its torch.compile executor, plain Thunder recomputes ``v0`` in the backward and runs the write into the
    input again, so ``w0``'s gradient reads row 0 raised twice. Eager agrees with cudagraphex (the Thunder paths mark
    the embedding as requiring grad, which takes no draw from the other cotangents); and without eager, cudagraphex,
    with the fusion executor after it, gives the gradient that Thunder gives without one: excused both ways."""
    lines = [
        Line("v0 = x1.reshape(x1.shape[0], -1)", "v0", frozenset({"x1"}), False, "view"),
        Line("v0[0].add_(1)", None, frozenset({"v0"}), True, "write_input"),
        Line("v1 = v0 @ w0", "v1", frozenset({"v0", "w0"}), False, "matmul"),
        Line("v2 = F.embedding(t0, e0)", "v2", frozenset({"t0", "e0"}), False, "embedding"),
    ]
    program = _program(
        width=6,
        tensors=[
            TensorSpec("x1", "BD", "x"),
            TensorSpec("w0", "DD", "param", requires_grad=True, init="torch.randn(d, d) / d**0.5"),
            TensorSpec("t0", "T", "tokens"),
            TensorSpec("e0", "VD", "param", init="torch.randn(vocab, d)"),
        ],
        lines=lines,
        outputs=["v2", "v1"],
        steps=[Step("call", Mode(), loss="now", form="direct")],
        min_region_size=2,
        fuser=True,
    )
    (failure,) = check(program).failures
    assert failure.label == "grad of c0 w0"
    assert "cudagraphex agrees with eager" in failure.excused
    by_thunder = fuser_departs(failure, BACKENDS["emulate"], executor("emulate", program.min_region_size))
    assert "departs from plain Thunder without it" in by_thunder
    plain = check(dataclasses.replace(program, fuser=False))
    assert plain.failures == []


def test_a_gradient_that_thunders_fusion_executor_changes_is_excused_where_cudagraphex_gives_its_own_without_it():
    """``var`` saves ``v0``, written later: eager refuses the backward. With its torch.compile executor plain Thunder
    recomputes ``v0`` in the backward, from before the write; without it, Thunder runs the write in its backward and
    refuses the backward that ``retain_graph`` left for later. cudagraphex gives the same gradient with and without the
    fusion executor, and without it the fuzzer excuses its difference from plain Thunder: excused."""
    lines = [
        Line("v0 = torch.maximum(x0, x0)", "v0", frozenset({"x0"}), False, "binary"),
        Line("v1 = v0.var(0)", "v1", frozenset({"v0"}), False, "reduce"),
        Line("v2 = v1.cos()", "v2", frozenset({"v1"}), False, "unary"),
        Line("v0[:, 0].mul_(2)", None, frozenset({"v0"}), True, "inplace_intermediate"),
    ]
    program = _program(
        width=6,
        tensors=[TensorSpec("x0", "BD", "x", requires_grad=True)],
        lines=lines,
        outputs=["v2", "x0[0]"],
        steps=[Step("call", Mode(), loss="retain", form="direct")],
        fuser=True,
    )
    (failure,) = check(program).failures
    assert failure.label == "grad of c0 x0"
    assert "computes what cudagraphex computes without it" in failure.excused
    (plain,) = check(dataclasses.replace(program, fuser=False)).failures
    assert plain.symptom.startswith("raises only without cudagraphex") and plain.excused


def test_an_error_that_only_thunders_fusion_executor_raises_is_excused_where_cudagraphex_gives_thunders_without_it():
    """Inductor fails on the code Thunder's torch.compile executor hands it for two writes into intermediates (it
    reads a name nothing defines). Eager refuses the backward (``sqrt`` saved its result, which the write changed), so
    it gives no verdict. cudagraphex, with the fusion executor, computes what plain Thunder computes without it:
    excused."""
    lines = [
        Line("v0 = x0.abs().sqrt()", "v0", frozenset({"x0"}), False, "unary"),
        Line("v0[:, 0].mul_(2)", None, frozenset({"v0"}), True, "inplace_intermediate"),
        Line("v1 = torch.exp(v0.tanh())", "v1", frozenset({"v0"}), False, "unary"),
        Line("v1.relu_()", None, frozenset({"v1"}), True, "inplace_intermediate"),
    ]
    program = _program(
        module=True,
        tensors=[TensorSpec("x0", "BD", "x", requires_grad=True)],
        lines=lines,
        outputs=["v1", "x0.t()"],
        steps=[Step("call", Mode(), loss="now", form="direct")],
        fuser=True,
    )
    (failure,) = check(program).failures
    assert failure.symptom.startswith("raises only without cudagraphex")
    assert "computes what Thunder computes without it" in failure.excused


def test_an_error_that_thunders_fusion_executor_raises_in_both_is_excused_where_both_agree_without_it():
    """With its torch.compile executor, plain Thunder fails in Dynamo and cudagraphex in Inductor's C++ code
    generation, for the regions' other code: both raise, with other errors. Without it, plain Thunder differs from
    eager and cudagraphex agrees with eager, which the fuzzer excuses: excused."""
    lines = [
        Line("v0 = F.dropout(x0, p=0.5, training=True)", "v0", frozenset({"x0"}), True, "dropout"),
        Line("v1 = torch.maximum(x0, v0)", "v1", frozenset({"x0", "v0"}), False, "binary"),
        Line("v1[:, 0].mul_(2)", None, frozenset({"v1"}), True, "inplace_intermediate"),
    ]
    program = _program(
        batches=(4,),
        tensors=[TensorSpec("x0", "BD", "x", requires_grad=True)],
        lines=lines,
        outputs=["v1", "v0"],
        steps=[Step("call", Mode(), loss="now")],
        fuser=True,
    )
    (failure,) = check(program).failures
    assert failure.symptom.startswith("reference raises Unsupported, cudagraphex InductorError")
    assert "fails in plain Thunder and in cudagraphex" in failure.excused
    assert "cudagraphex agrees with eager" in failure.excused


def _whole_step_writing_x0_saved_for_w0(write: list[Line], outputs: list[str], layout: str) -> Program:
    """Whole steps of ``v0 = x0 @ w0.t()`` then ``write`` into ``x0``, with SGD: a first step with a backward, which
    eager refuses (``x0`` is saved for ``w0``'s gradient), and a second without one, on inputs of ``layout``."""
    return _program(
        module=True,
        tensors=[
            TensorSpec("x0", "BD", "x"),
            TensorSpec("w0", "DD", "param", requires_grad=True, init="torch.randn(d, d) / d**0.5"),
        ],
        lines=[Line("v0 = x0 @ self.w0.t()", "v0", frozenset({"x0", "self.w0"}), False, "matmul"), *write],
        outputs=outputs,
        steps=[Step("call", Mode(), loss="now"), Step("call", Mode(), layout=layout)],
        min_region_size=2,
        whole_step=True,
        optimizer="sgd",
    )


def test_a_whole_step_input_write_that_plain_thunder_makes_only_in_its_backward_is_judged_by_that_backward():
    """``x0.detach().add_(x0)`` doubles the input; plain Thunder moves the write into its backward, so the second step,
    which runs none, leaves ``x0`` as it was. Eager refuses the first step's backward (``x0`` is saved for ``w0``'s
    gradient) and so skips its SGD step: no verdict. Thunder's torch.compile executor fails on the transposed input
    (Inductor refuses that write into a view of an input). Plain Thunder given a backward at the second step doubles
    ``x0`` as cudagraphex does: excused."""
    write = [
        Line("v1 = x0.detach()", "v1", frozenset({"x0"}), False, "detach"),
        Line("v1.add_(x0)", None, frozenset({"v1", "x0"}), True, "write_input"),
    ]
    program = _whole_step_writing_x0_saved_for_w0(write, ["v0", "self.w0"], layout="transposed")
    (failure,) = check(program).failures
    assert failure.step == 1 and failure.symptom == "input NAME after the call: values"
    assert "plain Thunder given a backward at that step writes the input as cudagraphex does" in failure.excused


def test_a_whole_step_output_that_is_an_input_plain_thunder_writes_only_in_its_backward_is_judged_by_that_backward():
    """The step returns ``x0``, which it writes in place: plain Thunder moves the write into its backward, so the
    second step, which runs none, returns ``x0`` as it was. Eager refuses the first step's backward (``x0`` is saved
    for ``w0``'s gradient): no verdict. Plain Thunder given a backward at the second step returns ``x0`` written, as
    cudagraphex does: excused."""
    write = [Line("x0[0].add_(1)", None, frozenset({"x0"}), True, "write_input")]
    program = _whole_step_writing_x0_saved_for_w0(write, ["v0", "x0"], layout="contiguous")
    (failure,) = check(program).failures
    assert failure.step == 1 and failure.symptom == "outN: values"
    assert "plain Thunder given a backward at that step writes the input as cudagraphex does" in failure.excused


def test_values_in_a_dtype_that_thunders_cache_gives_both_thunder_paths_are_judged_by_eager_in_that_dtype():
    """A no-grad step after one under autocast: Thunder's cache hands both Thunder paths the autocast entry, so both
    return bfloat16 where eager returns float32; plain Thunder's entry is also the grad one, which moves the write
    ``v0[:, 0].mul_(2)`` into its backward, so its output misses it. cudagraphex's values are eager's, rounded to
    bfloat16: excused by eager, whose values are compared in the dtype the Thunder paths share."""
    lines = [
        Line(
            "v0 = F.scaled_dot_product_attention(x0[None], x0[None], x0[None], is_causal=True)[0]",
            "v0",
            frozenset({"x0"}),
            False,
            "sdpa",
        ),
        Line("v0[:, 0].mul_(2)", None, frozenset({"v0"}), True, "inplace_intermediate"),
        Line("v1 = F.embedding(t0, self.e0)", "v1", frozenset({"t0", "self.e0"}), False, "embedding"),
    ]
    program = _program(
        module=True,
        batches=(3,),
        tensors=[
            TensorSpec("x0", "BD", "x"),
            TensorSpec("t0", "T", "tokens"),
            TensorSpec("e0", "VD", "param", requires_grad=True, init="torch.randn(vocab, d)"),
        ],
        lines=lines,
        outputs=["v1", "v0"],
        steps=[Step("call", Mode(autocast=True), loss="now", form="direct"), Step("call", Mode(grad=False))],
        whole_step=True,
    )
    (failure,) = check(program).failures
    assert failure.step == 1 and failure.symptom == "outN: values"
    assert failure.excused.startswith("plain Thunder differs from eager here, and cudagraphex agrees with eager")


def test_a_dtype_that_thunders_cache_gives_by_the_order_of_calls_is_excused_where_thunder_in_that_order_agrees():
    """A bucketed step pads the first call into its graph, so Thunder's function first sees a call of that size under
    autocast. The last call runs as is (its ``direct`` flag misses the graph's guards), without autocast: Thunder
    0.2.6 hands it the entry compiled under autocast, and it returns bfloat16. Plain Thunder's run saw such a call
    without autocast first. Plain Thunder given the calls in the step's order returns bfloat16 too: excused."""
    lines = [
        Line("v0 = F.linear(x0, w0, p0)", "v0", frozenset({"x0", "w0", "p0"}), False, "linear"),
        Line("v1 = F.linear(v0, w0, p0)", "v1", frozenset({"v0", "w0", "p0"}), False, "linear"),
    ]
    program = _program(
        width=6,
        batches=(2, 4),
        tensors=[
            TensorSpec("x0", "BD", "x", requires_grad=True),
            TensorSpec("w0", "DD", "param", init="torch.randn(d, d) / d**0.5"),
            TensorSpec("p0", "D", "param", requires_grad=True, init="torch.randn(d) * 0.5"),
        ],
        lines=lines,
        outputs=["v1", "v0"],
        steps=[
            Step("call", Mode(), fresh=False),
            Step("call", Mode(autocast=True)),
            Step("call", Mode(), form="direct"),
        ],
    ).as_bucketed_steps()
    (failure,) = check(program).failures
    assert failure.step == 2 and failure.symptom == "outN: dtype"
    assert "given the calls that the bucketed step passed to its function in that order" in failure.excused


def test_a_program_with_a_fusion_executor_is_compared_within_a_tolerance():
    """Inductor rounds by the fusions it is handed, which graph regions change: to two units in the last place of
    autocast's bfloat16 (the bound seed 7516 needs), closer in float32. Without a fusion executor the CPU replay
    backend is compared to the last bit."""
    program = _program(
        batches=(4,),
        tensors=[],
        lines=[],
        outputs=[],
        steps=[],
    )
    ref, got = Observations(), Observations()
    value = torch.full((4,), 0.3)
    ref.add("out0", value)
    got.add("out0", torch.nextafter(value, torch.ones(4)))
    emulate = BACKENDS["emulate"]
    assert compare_step(program, emulate, 0, ref, got).symptom == "outN: values (within a tolerance)"
    assert compare_step(dataclasses.replace(program, fuser=True), emulate, 0, ref, got) is None
    got.items.clear()
    got.add("out0", value + 1e-3)
    assert compare_step(dataclasses.replace(program, fuser=True), emulate, 0, ref, got) is not None
    low = torch.tensor([1.5, 0.0, -0.25, 2.0], dtype=torch.bfloat16)
    # Two units in the last place of each value, and of 1.0 where the value is 0.
    rounded_apart = low + torch.tensor([0.015625, 0.015625, 0.00390625, 0.03125], dtype=torch.bfloat16)
    for off, departs in ((rounded_apart, False), (low + 0.0625, True)):
        ref.items.clear()
        got.items.clear()
        ref.add("out0", low)
        got.add("out0", off)
        assert (compare_step(dataclasses.replace(program, fuser=True), emulate, 0, ref, got) is not None) == departs


def test_values_from_a_call_under_autocast_on_with_a_fusion_executor_are_compared_within_bfloat16s_tolerance():
    """Inductor places autocast's bfloat16 roundings by the fusions it is handed, and they reach float32 results (a
    gradient through bfloat16 products) and what the call leaves behind. From the first call under autocast on, a
    program with a fusion executor is compared within two units in the last place of bfloat16; before it, and without
    a fusion executor, as before."""
    steps = [Step("call", Mode()), Step("call", Mode(autocast=True)), Step("call", Mode())]
    program = _program(batches=(4,), tensors=[], lines=[], outputs=[], steps=steps)
    fused = dataclasses.replace(program, fuser=True)
    emulate = BACKENDS["emulate"]
    ref, got = Observations(), Observations()
    value = torch.full((4,), 1.41357)
    ref.add("out0", value)
    got.add("out0", value - 0.00928)  # less than one unit in the last place of bfloat16 there
    assert compare_step(fused, emulate, 0, ref, got) is not None
    assert compare_step(fused, emulate, 1, ref, got) is None
    assert compare_step(fused, emulate, 2, ref, got) is None
    assert compare_step(program, emulate, 2, ref, got) is not None
    got.items.clear()
    got.add("out0", value - 0.05)  # more than two units in the last place of bfloat16
    assert compare_step(fused, emulate, 2, ref, got) is not None
