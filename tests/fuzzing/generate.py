"""A random program and its call pattern from a seed."""

from __future__ import annotations

import dataclasses
import random

from tests.fuzzing.builder import Builder
from tests.fuzzing.programs import Mode, Program, Step


def generate(seed: int) -> Program:
    """A random program and call pattern, a function of ``seed`` alone."""
    r = random.Random(seed)
    b = Builder(r, module=r.random() < 0.6)
    b.x()
    if r.random() < 0.35:
        b.x()
    ops = list(Builder.OPS)
    weights = list(Builder.OPS.values())
    n_ops = r.randint(2, 4)
    attempts = 0
    while sum(not ln.text.startswith("h") for ln in b.lines) < n_ops and attempts < 50:
        attempts += 1
        getattr(b, f"op_{r.choices(ops, weights=weights)[0]}")()
    outputs = b.outputs()
    program = Program(
        seed=seed,
        module=b.module,
        width=r.choice([4, 6]),
        batches=tuple(r.sample([2, 3, 4], 2)),
        tensors=b.tensors,
        lines=b.lines,
        outputs=outputs,
        steps=[],
        position="first" if seed % 2 == 0 else "last",
        min_region_size=1 + (seed // 2) % 2,
    )
    program.threads = not program.random and r.random() < 0.04
    program.steps = _call_pattern(r, program)
    return program


def _call_pattern(r: random.Random, program: Program) -> list[Step]:
    trainable = any(t.requires_grad for t in program.tensors)
    base = Mode(grad=trainable and r.random() < 0.8)
    modes = [base]
    for _ in range(r.choices([0, 1, 2], weights=[7, 3, 0.5])[0]):
        # Thunder's prologue rejects a module whose parameters changed dtype (an AssertionError, not a new entry)
        what = r.choice(["batch", "grad", "training"] if program.module else ["batch", "dtype", "grad"])
        if what == "batch":
            m = dataclasses.replace(base, batch=1)
        elif what == "dtype":
            m = dataclasses.replace(base, dtype="float64")
        elif what == "grad":
            m = dataclasses.replace(base, grad=not base.grad and trainable)
        else:
            m = dataclasses.replace(base, training=False)
        if m not in modes:
            modes.append(m)
    # Drawn apart from ``r``, so that the programs of every seed stay what they were without autocast.
    if random.Random(f"autocast {program.seed}").random() < 0.15:
        modes.append(dataclasses.replace(base, autocast=True))
    plan = [m for m in modes for _ in range(r.randint(3, 5))]
    if len(modes) > 1 and r.random() < 0.5:
        plan += [r.choice(modes[:-1])] * r.randint(1, 2)
    if r.random() < 0.25:
        r.shuffle(plan)

    steps: list[Step] = []
    dtype, training = "float32", True
    pending = 0
    held: list[str] = []
    float_inputs = [t for t in program.inputs if t.is_float and t.kind != "S"]

    def flush():
        nonlocal pending
        while pending:
            steps.append(Step("backward", target=r.choice(["first", "last"])))
            pending -= 1

    for n, mode in enumerate(plan):
        if mode.dtype != dtype:
            flush()
            steps.append(Step("dtype", target=mode.dtype))
            dtype = mode.dtype
        if mode.training != training:
            steps.append(Step("train" if mode.training else "eval"))
            training = mode.training
        loss = "none"
        if mode.grad:
            loss = r.choices(["none", "now", "retain", "pending"], weights=[2, 4, 1, 3])[0]
            if loss == "pending" and pending >= 3:
                loss = "now"
        keep = r.choices(["drop", "hold", "mutate"], weights=[5, 3.5, 1.5])[0]
        steps.append(
            Step(
                "call",
                mode=mode,
                layout=r.choices(["contiguous", "transposed", "strided"], weights=[5, 1, 1])[0],
                fresh=r.random() < 0.5,
                keep=keep,
                loss=loss,
                form=r.choice(["sum", "direct"]),
                variant=r.choices([0, 1, 2, 3, 4], weights=[3, 1, 1, 1, 1])[0],
            )
        )
        if loss == "pending":
            pending += 1
        if keep == "hold":
            held.append(f"c{n}")
        if float_inputs and r.random() < 0.25:
            target = r.choice(float_inputs)
            # a plain in-place write into a leaf that requires grad raises, in eager too: rarely
            variant = r.choices([0, 1, 2, 3], weights=[4, 2, 0.3 if target.requires_grad else 1, 1])[0]
            steps.append(Step("write_input", target=target.name, variant=variant))
        if held and r.random() < 0.2:
            steps.append(
                Step(
                    "write_output",
                    target=r.choice(held),
                    variant=r.choices([0, 1, 2, 3, 4], weights=[3, 1, 2, 1, 1])[0],
                )
            )
        if pending and r.random() < 0.3:
            retain = r.random() < 0.2
            steps.append(Step("backward", target=r.choice(["first", "last"]), retain=retain))
            pending -= not retain
        if r.random() < 0.1:
            steps.append(Step("zero_grad"))
    flush()
    return steps
