"""Compares what two runs of one program let a caller observe, step by step."""

from __future__ import annotations

import re
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

import torch

from tests.fuzzing.programs import Program
from tests.fuzzing.world import BackendSpec, Observations, TensorSnapshot, World, lockstep


@dataclass
class Failure:
    seed: int
    step: int
    label: str
    detail: str
    symptom: str  # a grouping key: what went wrong, with names and numbers taken out
    program: Program = field(repr=False)
    #: Set when plain Thunder is the one that differs (see :func:`tests.fuzzing.triage.triage`): reported, not counted as a failure.
    excused: str = ""
    #: Values that differ only within a tolerance: excused only where eager agrees with cudagraphex exactly.
    nearly_equal: bool = False

    def report(self, full: bool = True) -> str:
        tag = f"NOTE (not counted: {self.excused})" if self.excused else "FAIL"
        text = f"{tag} seed={self.seed} step {self.step} [{self.symptom}]\n  {self.label}: {self.detail}"
        if full:
            text += "\n" + _indent(self.program.describe())
        return text


def _indent(text: str, by: str = "  ") -> str:
    return "\n".join(by + line for line in text.splitlines())


def normalise(message: str) -> str:
    message = message.splitlines()[0] if message else ""
    message = re.sub(r"\[[^\]]*\]", "[...]", message)
    message = re.sub(r"'[^']*'", "'...'", message)
    message = re.sub(r"\b(t|v|x|s|c|w|p|b|m|h|i|k|e|g)\d+\b", "N", message)
    message = re.sub(r"\d+", "N", message)
    return message[:120]


def _label_kind(label: str) -> str:
    label = re.sub(r"\bc\d+\b", "cN", label)
    label = re.sub(r"\[\d+\]", "[i]", label)
    label = re.sub(r"out\d+", "outN", label)
    label = re.sub(r"(input|state|grad of cN|grad of state) \w+", r"\1 NAME", label)
    return label


#: What an observation lacks where one world did not observe it.
MISSING = object()
_META_KEYS = ("shape", "dtype", "stride", "device", "requires_grad", "is_leaf")


def compare_value(a: Any, b: Any, mode: str, values_only: bool = False) -> str | None:
    """None when ``a`` (reference) and ``b`` (cudagraphex) agree; mode is exact, close, autocast (close, at least
    bfloat16's tolerance), stats or meta. With ``values_only`` a tensor's metadata is not compared, except its shape;
    floating values of two dtypes are compared in the less precise one (Thunder's cache may hand both Thunder paths
    an autocast entry's dtype, which eager, the witness, does not share)."""
    if isinstance(a, TensorSnapshot) != isinstance(b, TensorSnapshot):
        return f"reference {_short(a)}, cudagraphex {_short(b)}"
    if not isinstance(a, TensorSnapshot):
        if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b):
            for i, (x, y) in enumerate(zip(a, b)):
                diff = compare_value(x, y, mode, values_only)
                if diff:
                    return f"[{i}] {diff}"
            return None
        if isinstance(a, float) and isinstance(b, float) and mode != "exact":
            if mode in ("meta", "stats") or abs(a - b) <= 1e-4 * max(1.0, abs(a)):
                return None
            return f"reference {a}, cudagraphex {b}"
        return None if a == b else f"reference {a!r}, cudagraphex {b!r}"
    for key in ("shape",) if values_only else _META_KEYS:
        if a.meta[key] != b.meta[key]:
            return f"{key}: reference {a.meta[key]}, cudagraphex {b.meta[key]}"
    x, y = a.value, b.value
    if x.dtype != y.dtype:  # values_only: the metadata check above catches it otherwise
        if not (x.is_floating_point() and y.is_floating_point()):
            return f"dtype: reference {x.dtype}, cudagraphex {y.dtype}"
        common = max(x.dtype, y.dtype, key=lambda dtype: torch.finfo(dtype).eps)
        x, y = x.to(common), y.to(common)
    if mode == "meta":
        return None
    if mode == "exact":
        if torch.equal(x.isnan(), y.isnan()) and torch.equal(x.nan_to_num(0.0), y.nan_to_num(0.0)):
            return None
    elif mode in ("close", "autocast"):
        if not x.is_floating_point():
            if torch.equal(x, y):
                return None
        elif torch.allclose(x, y, **_close_tolerance(x.dtype, autocast=mode == "autocast"), equal_nan=True):
            return None
    else:
        return _compare_stats(x, y)
    return f"values differ: {_diff(x, y)}"


def _close_tolerance(dtype: torch.dtype, autocast: bool = False) -> dict[str, float]:
    """``rtol`` and ``atol`` of the "close" mode: two units in the last place of bfloat16 and float16 (autocast's
    dtypes, where a rounding that a fusion boundary moves is that large), tighter bounds for wider dtypes; with
    ``autocast`` (the "autocast" mode), bfloat16's for wider dtypes as well."""
    two_ulps = 2 * max(torch.finfo(dtype).eps, torch.finfo(torch.bfloat16).eps if autocast else 0.0)
    return {"rtol": max(1e-4, two_ulps), "atol": max(1e-5, two_ulps)}


def _compare_stats(x: torch.Tensor, y: torch.Tensor) -> str | None:
    """Random programs on CUDA: the same number of finite elements, and close zero fraction (dropout's keep rate),
    mean and spread. Tensors under 256 elements are compared by their metadata only."""
    if not x.is_floating_point():
        return None
    xf, yf = x.double().flatten(), y.double().flatten()
    fx, fy = int(xf.isfinite().sum()), int(yf.isfinite().sum())
    if fx != fy:
        return f"finite elements: reference {fx}, cudagraphex {fy}"
    xf, yf = xf[xf.isfinite()], yf[yf.isfinite()]
    n = xf.numel()
    if n < 256:
        return None
    zx, zy = float((xf == 0).double().mean()), float((yf == 0).double().mean())
    if abs(zx - zy) > 0.05 + 4 * (0.25 / n) ** 0.5:
        return f"zero fraction: reference {zx:.3f}, cudagraphex {zy:.3f}"
    sx, sy = float(xf.std()), float(yf.std())
    mx, my = float(xf.mean()), float(yf.mean())
    if abs(mx - my) > 0.25 * max(sx, sy) + 1e-5:
        return f"mean: reference {mx:.4g}, cudagraphex {my:.4g} (std {sx:.4g}/{sy:.4g})"
    if not (0.6 <= (sx + 1e-9) / (sy + 1e-9) <= 1.6):
        return f"std: reference {sx:.4g}, cudagraphex {sy:.4g}"
    return None


def abs_difference(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``|x - y|`` elementwise in float64, a NaN on either side counting as an infinite difference."""
    return (x.double() - y.double()).abs().nan_to_num(float("inf"))


def largest_difference(a: Any, b: Any) -> float | str:
    """The largest absolute difference between two observed values (tensors, or sequences of them), or why there is
    none to give: "-" where ``b`` is :data:`MISSING`, "shape", or "other" (values of other kinds, or unequal ones
    that are not tensors)."""
    if b is MISSING:
        return "-"
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b):
        parts = [largest_difference(x, y) for x, y in zip(a, b)]
        reasons = [p for p in parts if isinstance(p, str)]
        return reasons[0] if reasons else max(parts, default=0.0)
    if isinstance(a, TensorSnapshot) and isinstance(b, TensorSnapshot):
        if a.value.shape != b.value.shape:
            return "shape"
        return float(abs_difference(a.value, b.value).max()) if a.value.numel() else 0.0
    if isinstance(a, TensorSnapshot) or isinstance(b, TensorSnapshot):
        return "other"
    return 0.0 if a == b else "other"


def _diff(x: torch.Tensor, y: torch.Tensor) -> str:
    try:
        d = abs_difference(x, y)
        at = int(d.argmax())
        ref, got = float(x.flatten()[at]), float(y.flatten()[at])
        return (
            f"max abs diff {float(d.max()):.3g} at flat index {at} of {x.numel()}"
            f" (reference {ref:.6g}, cudagraphex {got:.6g}; largest reference magnitude {float(x.abs().max()):.3g})"
        )
    except Exception:  # noqa: BLE001 - a description only
        return "(not comparable)"


def _short(v: Any) -> str:
    if isinstance(v, TensorSnapshot):
        return f"tensor{list(v.meta['shape'])}"
    return repr(v)[:60]


def value_mode(label: str, mode: str) -> str:
    return "exact" if label in ("identity", "shared memory") or "equals the previous" in label else mode


def observed_alike(failure: Failure, a: Observations, b: Observations, mode: str, values_only: bool = False) -> bool:
    """Whether two worlds observed what failed alike (:func:`compare_value` in ``mode``); False where one did not."""
    x, y = dict(a.items).get(failure.label, MISSING), dict(b.items).get(failure.label, MISSING)
    return x is not MISSING and y is not MISSING and compare_value(x, y, mode, values_only) is None


def compare_step(program: Program, backend: BackendSpec, index: int, ref: Observations, got: Observations):
    # Padding changes the batch a matrix product sees, and with it the last bits of its rows.
    mode = "close" if program.bucketed else backend.compare
    if mode == "close" and program.random:
        mode = "stats"
    # Inductor rounds by the fusions it is handed, and graph regions hand it other ones; the draws are still the same.
    if program.fuser and mode == "exact":
        mode = "close"
    # Under autocast its bfloat16 roundings reach float32 results too (a gradient through bfloat16 products), and what
    # such a call leaves (accumulated gradients, written tensors) carries them into later steps.
    if (
        program.fuser
        and mode == "close"
        and any(s.mode is not None and s.mode.autocast for s in program.steps[: index + 1])
    ):
        mode = "autocast"
    for (label, a), (label_b, b) in zip(ref.items, got.items):
        if label != label_b:
            detail = f"observed {label_b!r} instead"
            return Failure(program.seed, index, label, detail, f"{_label_kind(label)}: other observations", program)
        diff = compare_value(a, b, value_mode(label, mode))
        if diff:
            what = diff.split(":")[0] if diff.startswith(_META_KEYS) else "values"
            nearly = what == "values" and mode == "exact" and compare_value(a, b, "close") is None
            if nearly:
                what = "values (within a tolerance)"
            return Failure(
                program.seed, index, label, diff, f"{_label_kind(label)}: {what}", program, nearly_equal=nearly
            )
    if (ref.raised is None) != (got.raised is None) or (
        ref.raised is not None and type(ref.raised) is not type(got.raised)
    ):
        if got.raised is not None:
            e = got.raised
            message = f"{type(e).__name__}: {normalise(str(e))}"
            if ref.raised is None:
                symptom = f"raises only with cudagraphex: {message}"
            else:
                symptom = f"reference raises {type(ref.raised).__name__}, cudagraphex {message}"
            detail = f"{type(e).__name__}: {str(e)[:400]}\n{_indent(got.where, '    ')}"
        else:
            e = ref.raised
            symptom = f"raises only without cudagraphex: {type(e).__name__}: {normalise(str(e))}"
            detail = f"{type(e).__name__}: {str(e)[:400]}"
        return Failure(program.seed, index, "exception", detail, symptom, program)
    if len(ref.items) != len(got.items) and ref.raised is None:
        detail = f"{len(ref.items)} observations against {len(got.items)}"
        return Failure(program.seed, index, "observations", detail, "other observations", program)
    return None


def run_alike(
    program: Program,
    backend: BackendSpec,
    worlds: tuple[World, World],
    steps: list,
    *,
    seeded: bool,
    leave_out: Collection[str] = (),
) -> bool:
    """Whether both ``worlds`` run ``steps`` in lock-step without raising and observe the same after each, but for the
    observations labelled in ``leave_out``."""
    for index, (a, b) in lockstep(program, worlds, steps, seeded=seeded):
        if a.raised is not None or b.raised is not None:
            return False
        if compare_step(program, backend, index, *(_without(o, leave_out) for o in (a, b))):
            return False
    return True


def _without(observed: Observations, labels: Collection[str]) -> Observations:
    """``observed`` without the observations labelled in ``labels`` (itself where there are none)."""
    if not labels:
        return observed
    kept = Observations()
    kept.items = [(label, value) for label, value in observed.items if label not in labels]
    return kept
