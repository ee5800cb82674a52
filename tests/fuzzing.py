"""Differential fuzzing of cudagraphex against Thunder without graphs.

``generate(seed)`` builds a small random program and a call pattern from a seeded ``random.Random``: a module (or a
function) whose body draws from a pool of ops (elementwise, matmul, reductions, views, in-place writes into inputs,
buffers and intermediates, ``index_copy_``, dropout and ``randn``-style ops, ``.item()``, scalar tensors, sdpa,
layer norm, embedding), and a list of steps (calls in several input signatures, grad modes and train/eval modes, held,
dropped and written outputs, writes into inputs after a call, backwards now, later, out of order or twice with
``retain_graph``). ``check(program, backend)`` compiles it twice, with cudagraphex (first or last in the executors
list, ``min_region_size`` 1 or 2, both chosen from the seed) and with plain ``thunder.jit`` (the reference), runs both
in lock-step and compares after every step what a caller can observe: outputs, their metadata and which tensors share
memory, values of inputs, parameters and buffers, gradients, held outputs, and exception types.

On the CPU replay backend (``"emulate"``) everything is compared exactly: both runs start every step from the same
``torch.manual_seed``, and the replay backend draws what Thunder draws. On ``"cuda"`` RNG-free programs are compared
within a tolerance and programs with random ops statistically (zero fraction, mean and spread; larger tensors there).

``python -m tests.fuzzing --backend emulate --count 2000 --start 0`` runs a batch and prints each failure (seed,
program, call pattern, error) and a summary; ``--show SEED`` prints one program; ``--shrink`` reduces each failing
program to a smaller one with the same symptom.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import linecache
import multiprocessing
import random
import re
import sys
import threading
import time
import traceback
import warnings
import zlib
from collections import Counter
from collections.abc import Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import Any, ClassVar

import thunder
import torch
from thunder.extend import Executor

from cudagraphex import CUDAGraphExecutor
from tests.helpers import install_cuda_device_guard

install_cuda_device_guard()  # thread programs compile in threads

# -- programs -------------------------------------------------------------------------------------------------------

#: Symbolic shapes of values: batch x width, width, batch x 1, 0-d, cache rows x width, width x width, vocab x width,
#: and the two integer kinds (distinct row indices into a cache, token ids).
FLOAT_KINDS = ("BD", "D", "B1", "S")


@dataclass(frozen=True)
class TensorSpec:
    """An input or a parameter/buffer of a program."""

    name: str
    kind: str  # BD, D, S, ND, DD, VD, I (index into ND rows), T (token ids)
    role: str  # "x" (data input), "state" (input written in place), "index", "tokens", "scalar"; "param", "buffer"
    requires_grad: bool = False
    persistent: bool = False  # an input: the same tensor on every call with the same signature
    init: str = ""  # a parameter or buffer: its initialiser, in terms of d, n and vocab

    @property
    def is_float(self) -> bool:
        return self.kind not in ("I", "T")


@dataclass(frozen=True)
class Line:
    """One statement of the program body."""

    text: str  # may span lines; parameters and buffers are written ``self.name``
    defines: str | None  # the value it assigns, if any
    uses: frozenset[str]
    effect: bool  # writes in place or draws random numbers
    category: str


@dataclass(frozen=True)
class Mode:
    """What decides a Thunder cache entry: batch size (an index into ``Program.batches``), dtype, grad, training."""

    batch: int = 0
    dtype: str = "float32"
    grad: bool = True
    training: bool = True

    def describe(self) -> str:
        return f"B#{self.batch} {self.dtype} {'grad' if self.grad else 'no_grad'}{'' if self.training else ' eval'}"


@dataclass(frozen=True)
class Step:
    """One step of the call pattern, applied to both compiled functions."""

    action: str  # call | backward | write_input | write_output | zero_grad | train | eval | dtype
    mode: Mode | None = None
    layout: str = "contiguous"  # of float inputs: contiguous | transposed | strided
    fresh: bool = True  # new input tensors (otherwise the ones of the last call with this signature and layout)
    keep: str = "drop"  # drop | hold (across later calls, checked after every step) | mutate (write one, then drop)
    loss: str = "none"  # none | now | retain (backward with retain_graph, then again) | pending (a later step)
    form: str = "sum"  # sum: (out * cotangent).sum() summed, .backward(); direct: torch.autograd.backward(outs, cots)
    target: str = ""  # write_input: input name; write_output: held label; backward: "first" | "last"; dtype: dtype
    variant: int = 0
    retain: bool = False  # backward: retain_graph=True (the loss stays pending)

    def describe(self) -> str:
        if self.action == "call":
            keep = f"mutate ({_WRITES[self.variant][0]})" if self.keep == "mutate" else self.keep
            parts = [self.mode.describe(), self.layout, "fresh" if self.fresh else "same inputs", keep]
            if self.loss != "none":
                parts.append(f"loss={self.loss}/{self.form}")
            return "call " + ", ".join(parts)
        if self.action == "backward":
            return f"backward {self.target} pending" + (" retain_graph" if self.retain else "")
        if self.action in ("write_input", "write_output"):
            return f"{self.action} {self.target} ({_WRITES[self.variant][0]})"
        if self.action == "dtype":
            return f"dtype {self.target}"
        return self.action


#: How write_input and write_output steps write: (description, function of the tensor).
_WRITES = (
    ("no_grad add_(1.5)", lambda t: _no_grad(lambda: t.add_(1.5))),
    ("no_grad mul_(-2)", lambda t: _no_grad(lambda: t.mul_(-2))),
    ("add_(1)", lambda t: t.add_(1)),
    ("no_grad zero_()", lambda t: _no_grad(lambda: t.zero_())),
    ("t_()", lambda t: t.t_()),
)


def _no_grad(fn):
    with torch.no_grad():
        return fn()


@dataclass
class Program:
    seed: int
    module: bool
    width: int
    batches: tuple[int, ...]
    tensors: list[TensorSpec]  # inputs in signature order, then parameters and buffers
    lines: list[Line]
    outputs: list[str]
    steps: list[Step]
    position: str  # "first" | "last"
    min_region_size: int
    threads: bool = False

    @property
    def inputs(self) -> list[TensorSpec]:
        return [t for t in self.tensors if t.role not in ("param", "buffer")]

    @property
    def params(self) -> list[TensorSpec]:
        return [t for t in self.tensors if t.role in ("param", "buffer")]

    @property
    def random(self) -> bool:
        return any(line.category in ("dropout", "random", "sdpa_dropout") for line in self.lines)

    @property
    def categories(self) -> list[str]:
        return [line.category for line in self.lines]

    def dims(self, scale: int) -> dict[str, int]:
        batches = [b * scale for b in self.batches]
        return {"d": self.width * scale, "n": 2 * max(batches), "vocab": 10 * scale, "batches": batches}

    # -- source -------------------------------------------------------------------------------------------------------

    def signature(self) -> list[str]:
        names = [t.name for t in self.inputs]
        return names if self.module else names + [t.name for t in self.params]

    def source(self) -> str:
        """The program as Python source: a module ``Fuzzed(d, n, vocab)`` or a function ``forward`` and
        ``make_tensors(d, n, vocab)`` (its parameters and buffers, passed as trailing arguments)."""
        out = ["import torch", "import torch.nn.functional as F", "", ""]
        body = [ln.text if self.module else ln.text.replace("self.", "") for ln in self.lines]
        outputs = [o if self.module else o.replace("self.", "") for o in self.outputs]
        ret = f"return ({', '.join(outputs)},)"
        if self.module:
            out += [
                "class Fuzzed(torch.nn.Module):",
                "    def __init__(self, d, n, vocab):",
                "        super().__init__()",
            ]
            for t in self.params:
                if t.role == "buffer":
                    out.append(f'        self.register_buffer("{t.name}", {t.init})')
                else:
                    out.append(f"        self.{t.name} = torch.nn.Parameter({t.init}, requires_grad={t.requires_grad})")
            out += [
                "",
                "    def __call__(self, *args):  # skips nn.Module's hooks, which Thunder would interpret",
                "        return self.forward(*args)",
                "",
                f"    def forward(self, {', '.join(self.signature())}):",
            ]
            indent = "        "
        else:
            out.append("def make_tensors(d, n, vocab):")
            out.append("    return {")
            for t in self.params:
                out.append(f'        "{t.name}": ({t.init}).requires_grad_({t.requires_grad}),')
            out += ["    }", "", "", f"def forward({', '.join(self.signature())}):"]
            indent = "    "
        for text in body:
            out += [indent + sub for sub in text.split("\n")]
        out.append(indent + ret)
        return "\n".join(out) + "\n"

    def describe(self) -> str:
        kinds = ", ".join(f"{t.name}:{t.kind}{' rg' if t.requires_grad else ''}" for t in self.inputs)
        head = (
            f"seed={self.seed} {'module' if self.module else 'function'} cudagraphex {self.position} "
            f"min_region_size={self.min_region_size} width={self.width} batches={self.batches}"
            f"{' threads' if self.threads else ''}\ninputs: {kinds}\nops: {' '.join(self.categories)}"
        )
        steps = "\n".join(f"  {i:2d} {s.describe()}" for i, s in enumerate(self.steps))
        return f"{head}\n{self.source()}steps:\n{steps}"


# -- the generator ----------------------------------------------------------------------------------------------------


@dataclass
class _Value:
    name: str
    kind: str
    intermediate: bool = False  # computed by the program, not a view of an input or parameter
    base: str | None = None  # the input or parameter it is (or is a view of)
    expanded: bool = False  # a broadcast view: never written in place
    requires_grad: bool = False  # a leaf input or parameter that requires grad (or a view of one)


class _Builder:
    def __init__(self, r: random.Random, module: bool):
        self.r = r
        self.module = module
        self.tensors: list[TensorSpec] = []
        self.values: list[_Value] = []
        self.lines: list[Line] = []
        self.hosts: list[str] = []
        self.count = 0

    # -- resources, created on first need

    def _add(self, t: TensorSpec) -> _Value:
        self.tensors.append(t)
        ref = f"self.{t.name}" if t.role in ("param", "buffer") else t.name
        v = _Value(ref, t.kind, base=ref, requires_grad=t.requires_grad)
        if t.is_float and t.kind != "DD" and t.kind != "VD":
            self.values.append(v)
        return v

    def _named(self, prefix: str) -> str:
        return f"{prefix}{sum(t.name.startswith(prefix) for t in self.tensors)}"

    def x(self) -> _Value:
        return self._add(TensorSpec(self._named("x"), "BD", "x", requires_grad=self.r.random() < 0.6))

    def state(self) -> _Value:
        kind = self.r.choice(["BD", "D"])
        return self._add(TensorSpec(self._named("s"), kind, "state", persistent=self.r.random() < 0.6))

    def find(self, pred) -> list[_Value]:
        return [v for v in self.values if pred(v)]

    def tensor_ref(self, role: str, kind: str, make) -> str:
        for t in self.tensors:
            if t.role == role and t.kind == kind:
                return f"self.{t.name}" if role in ("param", "buffer") else t.name
        return make().name

    def param(self, kind: str, prefix: str, init: str) -> _Value:
        rg = self.r.random() < 0.8 if self.module else self.r.random() < 0.6
        return self._add(TensorSpec(self._named(prefix), kind, "param", requires_grad=rg, init=init))

    def weight(self) -> str:
        existing = [f"self.{t.name}" for t in self.tensors if t.kind == "DD"]
        if existing and self.r.random() < 0.7:
            return self.r.choice(existing)
        return self.param("DD", "w", "torch.randn(d, d) / d**0.5").name

    def bias(self) -> str:
        return self.tensor_ref("param", "D", lambda: self.param("D", "p", "torch.randn(d) * 0.5"))

    def index(self) -> str:
        return self.tensor_ref("index", "I", lambda: self._add(TensorSpec("i0", "I", "index")))

    def cache(self) -> _Value:
        caches = self.find(lambda v: v.kind == "ND")
        if caches and self.r.random() < 0.8:
            return self.r.choice(caches)
        if self.module and self.r.random() < 0.5:
            return self._add(TensorSpec(self._named("m"), "ND", "buffer", init="torch.zeros(n, d)"))
        return self._add(TensorSpec(self._named("c"), "ND", "state", persistent=self.r.random() < 0.8))

    # -- values

    def pick(self, kinds: Sequence[str], pred=None) -> _Value | None:
        cands = [v for v in self.values if v.kind in kinds and (pred is None or pred(v))]
        if not cands:
            return None
        return self.r.choices(cands, weights=[1 + 2 * i for i in range(len(cands))])[0]

    def emit(
        self, text: str, uses: Iterable[str], category: str, effect: bool = False, kind: str | None = None, **value
    ) -> _Value | None:
        defines = None
        v = None
        if kind is not None:
            defines = f"v{self.count}"
            self.count += 1
            text = f"{defines} = {text}"
            v = _Value(defines, kind, **({"intermediate": True} | value))
            self.values.append(v)
        used = frozenset(u for u in uses if u)
        self.lines.append(Line(text, defines, used, effect, category))
        return v

    # -- ops: each returns whether it emitted something

    def op_unary(self) -> bool:
        a = self.pick(("BD", "D", "B1"))
        if a is None:
            return False
        expr = self.r.choice(
            [
                "{a}.sin()",
                "{a}.cos()",
                "torch.tanh({a})",
                "torch.sigmoid({a})",
                "torch.relu({a})",
                "({a} * 0.5 + 0.25)",
                "{a}.abs().sqrt()",
                "torch.exp({a}.tanh())",
                "{a}.square()",
            ]
        ).format(a=a.name)
        self.emit(expr, [a.name], "unary", kind=a.kind)
        return True

    def op_binary(self) -> bool:
        a = self.pick(("BD",))
        b = self.pick(("BD", "D", "B1", "S"))
        if a is None or b is None:
            return False
        op = self.r.choice(["+", "-", "*", "*", "max", "where"])
        if op == "max":
            expr = f"torch.maximum({a.name}, {b.name})"
        elif op == "where":
            expr = f"torch.where({a.name} > 0, {a.name}, {b.name})"
        else:
            expr = f"{a.name} {op} {b.name}"
        self.emit(expr, [a.name, b.name], "binary", kind="BD")
        return True

    def op_matmul(self) -> bool:
        a = self.pick(("BD",))
        if a is None:
            return False
        w = self.weight()
        form = self.r.randrange(3)
        if form == 2:
            p = self.bias()
            self.emit(f"F.linear({a.name}, {w}, {p})", [a.name, w, p], "linear", kind="BD")
        else:
            self.emit(f"{a.name} @ {w}{'.t()' if form else ''}", [a.name, w], "matmul", kind="BD")
        return True

    def op_attention(self) -> bool:
        q, k, v = (self.pick(("BD",)) for _ in range(3))
        if q is None:
            return False
        self.emit(
            f"torch.softmax({q.name} @ {k.name}.t(), -1) @ {v.name}", [q.name, k.name, v.name], "attention", kind="BD"
        )
        return True

    def op_reduce(self) -> bool:
        a = self.pick(("BD",))
        if a is None:
            return False
        expr, kind = self.r.choice(
            [
                ("{a}.sum(-1, keepdim=True)", "B1"),
                ("{a}.mean(0)", "D"),
                ("{a}.amax(-1, keepdim=True)", "B1"),
                ("{a}.sum()", "S"),
                ("{a}.softmax(-1)", "BD"),
                ("{a}.var(0)", "D"),
                ("{a}.cumsum(0)", "BD"),
            ]
        )
        self.emit(expr.format(a=a.name), [a.name], "reduce", kind=kind)
        return True

    def op_view(self) -> bool:
        a = self.pick(("BD", "D"))
        if a is None:
            return False
        if a.kind == "D":
            x = self.pick(("BD",))
            if x is None:
                return False
            self.emit(
                f"{a.name}.expand({x.name}.shape)",
                [a.name, x.name],
                "view",
                kind="BD",
                intermediate=False,
                base=a.base or a.name,
                expanded=True,
                requires_grad=a.requires_grad,
            )
            return True
        expr = self.r.choice(
            [
                "{a}.reshape(-1).view({a}.shape)",
                "{a}.t().t()",
                "{a}.reshape({a}.shape[0], -1)",
                "{a}.unsqueeze(0)[0]",
                "{a}[:, :]",
                "{a}.transpose(0, 1).contiguous().transpose(0, 1)",
                "{a}.roll(1, 0)",
            ]
        )
        copying = "contiguous" in expr or "roll" in expr
        self.emit(
            expr.format(a=a.name),
            [a.name],
            "view",
            kind="BD",
            intermediate=copying or a.intermediate,
            base=None if copying else (a.base or (None if a.intermediate else a.name)),
            expanded=a.expanded and not copying,
            requires_grad=a.requires_grad and not copying,
        )
        return True

    def op_detach(self) -> bool:
        a = self.pick(("BD",))
        if a is None:
            return False
        self.emit(f"{a.name}.detach()", [a.name], "detach", kind="BD", intermediate=a.intermediate, base=a.base)
        return True

    def op_inplace_intermediate(self) -> bool:
        a = self.pick(("BD",), lambda v: v.intermediate and not v.expanded and not v.requires_grad)
        b = self.pick(("BD", "D", "B1", "S"))
        if a is None or b is None:
            return False
        if b.kind != "BD":
            b = self.pick(("BD",))
        text = self.r.choice(
            [
                "{a}.add_({b})",
                "{a}.mul_({b})",
                "{a}.relu_()",
                "{a}.clamp_(-1, 1)",
                "{a}.copy_({b})",
                "{a}[:, 0].mul_(2)",
                "{a}.sub_({b}.detach())",
            ]
        ).format(a=a.name, b=b.name)
        self.emit(text, [a.name, b.name], "inplace_intermediate", effect=True)
        return True

    def op_write_input(self) -> bool:
        s = self.pick(
            ("BD", "D"),
            lambda v: v.base is not None and not v.requires_grad and not v.expanded and not v.base.startswith("self."),
        )
        if s is None or self.r.random() < 0.3:
            s = self.state()
        b = self.pick((s.kind,)) if s.kind == "D" else self.pick(("BD", "D", "B1", "S"))
        if b is None:
            return False
        detach = ".detach()" if self.r.random() < 0.5 else ""
        forms = ["{s}.add_({b}{d})", "{s}.mul_(0.5)", "{s}[0].add_(1)", "{s}.mul_(0.9).add_({b}{d})"]
        if b.kind == s.kind:
            forms.append("{s}.copy_({b}{d})")
        text = self.r.choice(forms).format(s=s.name, b=b.name, d=detach)
        self.emit(text, [s.name, b.name], "write_input", effect=True)
        return True

    def op_write_grad_input(self) -> bool:
        x = self.pick(("BD",), lambda v: v.requires_grad and not v.name.startswith("self."))
        if x is None:
            return False
        self.emit(f"{x.name}.mul_(2)", [x.name], "write_grad_leaf", effect=True)
        return True

    def op_index_copy(self) -> bool:
        b = self.pick(("BD",))
        if b is None:
            return False
        c = self.cache()
        i = self.index()
        detach = ".detach()" if self.r.random() < 0.4 else ""
        form = self.r.choices(["index_copy_", "setitem"], weights=[6, 1])[0]
        if form == "setitem":
            text = f"{c.name}[{i}] = {b.name}{detach}"
        else:
            text = f"{c.name}.{form}(0, {i}, {b.name}{detach})"
        self.emit(text, [c.name, i, b.name], "index_copy", effect=True)
        if self.r.random() < 0.7:
            self.op_readback(c)
        return True

    def op_readback(self, c: _Value | None = None) -> bool:
        c = c or self.pick(("ND",))
        if c is None:
            return False
        form = self.r.randrange(4)
        if form == 0:
            i = self.index()
            self.emit(f"{c.name}.index_select(0, {i})", [c.name, i], "readback", kind="BD")
        elif form == 1:
            self.emit(f"{c.name}.sum(0)", [c.name], "readback", kind="D")
        elif form == 2:
            x = self.pick(("BD",))
            self.emit(
                f"{c.name}[: {x.name}.shape[0]]",
                [c.name, x.name],
                "readback",
                kind="BD",
                intermediate=False,
                base=c.base,
            )
        else:
            x = self.pick(("BD",))
            self.emit(f"{c.name}[: {x.name}.shape[0]] * 2", [c.name, x.name], "readback", kind="BD")
        return True

    def op_buffer(self) -> bool:
        if not self.module:
            return False
        v = self.pick(("BD",))
        if v is None:
            return False
        buf = self.tensor_ref(
            "buffer", "D", lambda: self._add(TensorSpec(self._named("b"), "D", "buffer", init="torch.randn(d)"))
        )
        detach = ".detach()" if self.r.random() < 0.75 else ""
        text = self.r.choice(
            [
                "{buf}.add_({v}{d}.mean(0))",
                "{buf}.mul_(0.9).add_({v}{d}.mean(0), alpha=0.1)",
                "{buf}.copy_({v}{d}.sum(0))",
                "with torch.no_grad():\n    {buf}.add_({v}.mean(0))",
            ]
        ).format(buf=buf, v=v.name, d=detach)
        self.emit(text, [buf, v.name], "buffer", effect=True)
        return True

    def op_param_write(self) -> bool:
        if not self.module:
            return False
        w = self.weight()
        self.emit(f"with torch.no_grad():\n    {w}.mul_(0.99)", [w], "param_write", effect=True)
        return True

    def op_dropout(self) -> bool:
        a = self.pick(("BD", "D"))
        if a is None:
            return False
        training = self.r.choice(["self.training", "True"]) if self.module else "True"
        p = self.r.choice([0.25, 0.5])
        self.emit(f"F.dropout({a.name}, p={p}, training={training})", [a.name], "dropout", effect=True, kind=a.kind)
        return True

    def op_random(self) -> bool:
        a = self.pick(("BD", "D"))
        if a is None:
            return False
        expr = self.r.choice(
            [
                "{a} + torch.randn_like({a})",
                "{a} * torch.rand_like({a})",
                "{a} + 0.1 * torch.randn({a}.shape, dtype={a}.dtype, device={a}.device)",
            ]
        ).format(a=a.name)
        self.emit(expr, [a.name], "random", effect=True, kind=a.kind)
        return True

    def op_item(self) -> bool:
        a = self.pick(FLOAT_KINDS)
        b = self.pick(("BD",))
        if a is None or b is None:
            return False
        host = f"h{len(self.hosts)}"
        self.hosts.append(host)
        self.lines.append(Line(f"{host} = {a.name}.mean().item()", host, frozenset([a.name]), False, "item"))
        self.emit(f"{b.name} * {host}", [b.name, host], "item", kind="BD")
        return True

    def op_scalar(self) -> bool:
        b = self.pick(("BD",))
        if b is None:
            return False
        k = self.tensor_ref("scalar", "S", lambda: self._add(TensorSpec("k0", "S", "scalar")))
        self.emit(f"{b.name} {self.r.choice(['*', '+'])} {k}", [b.name, k], "scalar", kind="BD")
        return True

    def op_sdpa(self) -> bool:
        q, k, v = (self.pick(("BD",)) for _ in range(3))
        if q is None:
            return False
        extra = ""
        if self.r.random() < 0.4:
            extra += f", dropout_p={self.r.choice([0.25, 0.5])}"
        if self.r.random() < 0.4:
            extra += ", is_causal=True"
        self.emit(
            f"F.scaled_dot_product_attention({q.name}[None], {k.name}[None], {v.name}[None]{extra})[0]",
            [q.name, k.name, v.name],
            "sdpa_dropout" if "dropout" in extra else "sdpa",
            effect="dropout" in extra,
            kind="BD",
        )
        return True

    def op_layer_norm(self) -> bool:
        a = self.pick(("BD",))
        if a is None:
            return False
        if self.r.random() < 0.6:
            g = self.tensor_ref("param", "D", lambda: self.param("D", "g", "1 + 0.1 * torch.randn(d)"))
            p = self.bias() if self.r.random() < 0.7 else "None"
            self.emit(f"F.layer_norm({a.name}, {a.name}.shape[-1:], {g}, {p})", [a.name, g, p], "layer_norm", kind="BD")
        else:
            self.emit(f"F.layer_norm({a.name}, {a.name}.shape[-1:])", [a.name], "layer_norm", kind="BD")
        return True

    def op_embedding(self) -> bool:
        t = self.tensor_ref("tokens", "T", lambda: self._add(TensorSpec("t0", "T", "tokens")))
        e = self.tensor_ref("param", "VD", lambda: self.param("VD", "e", "torch.randn(vocab, d)"))
        self.emit(f"F.embedding({t}, {e})", [t, e], "embedding", kind="BD")
        return True

    OPS: ClassVar[dict[str, float]] = {
        "unary": 4,
        "binary": 4,
        "matmul": 3,
        "attention": 0.7,
        "reduce": 2.5,
        "view": 2,
        "detach": 0.5,
        "inplace_intermediate": 1.5,
        "write_input": 2,
        "write_grad_input": 0.15,
        "index_copy": 1.8,
        "readback": 0.6,
        "buffer": 1.5,
        "param_write": 0.3,
        "dropout": 1.5,
        "random": 1,
        "item": 0.8,
        "scalar": 0.6,
        "sdpa": 1,
        "layer_norm": 1,
        "embedding": 0.7,
    }

    # -- outputs

    def outputs(self) -> list[str]:
        r = self.r
        cands = [v for v in self.values if v.kind in FLOAT_KINDS and v.intermediate]
        outs: list[str] = []
        if cands:
            outs.append(cands[-1].name)
            for _ in range(r.choice([0, 0, 1, 2])):
                v = r.choice(cands).name
                if v not in outs or r.random() < 0.1:
                    outs.append(v)
        inputs = [t.name for t in self.tensors if t.role in ("x", "state") and t.kind == "BD"]
        if inputs and r.random() < 0.3:
            outs.append(r.choice(["{x}.reshape(-1)", "{x}[0]", "{x}.t()", "{x}"]).format(x=r.choice(inputs)))
        params = [f"self.{t.name}" for t in self.tensors if t.kind in ("DD", "D") and t.role in ("param", "buffer")]
        if params and r.random() < 0.3:
            outs.append(r.choice(["{p}.view(-1)", "{p}[0]", "{p}.t()", "{p}"]).format(p=r.choice(params)))
        scalars = {v.name for v in cands if v.kind == "S"}
        if outs and outs[0] in (v.name for v in cands) and r.random() < 0.1 and outs[0] not in scalars:
            outs.append(r.choice(["{o}[0]", "{o}.unsqueeze(0)"]).format(o=outs[0]))
        caches = [v.name for v in self.values if v.kind == "ND" and not v.name.startswith("self.")]
        if caches and r.random() < 0.1:
            outs.append(r.choice(caches))
        if self.hosts and r.random() < 0.3:
            outs.append(self.hosts[-1])
        if not outs:
            outs.append(self.values[0].name)
        return outs


def generate(seed: int) -> Program:
    """A random program and call pattern, a function of ``seed`` alone."""
    r = random.Random(seed)
    b = _Builder(r, module=r.random() < 0.6)
    b.x()
    if r.random() < 0.35:
        b.x()
    ops = list(_Builder.OPS)
    weights = list(_Builder.OPS.values())
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


# -- running ----------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BackendSpec:
    name: str
    device: str
    scale: int  # multiplies the program's sizes (statistics need larger tensors)
    compare: str  # "exact" | "close"


BACKENDS = {
    "emulate": BackendSpec("emulate", "cpu", 1, "exact"),
    "cuda": BackendSpec("cuda", "cuda", 8, "close"),
}

_executors: dict[tuple[str, int], CUDAGraphExecutor] = {}


def executor(backend: str, min_region_size: int) -> CUDAGraphExecutor:
    key = (backend, min_region_size)
    if key not in _executors:
        _executors[key] = CUDAGraphExecutor(
            f"cudagraphex_fuzz_{backend}_{min_region_size}", backend=backend, min_region_size=min_region_size
        )
    return _executors[key]


def _seed(*key: Any) -> int:
    return zlib.crc32(repr(key).encode())


_DTYPES = {"float32": torch.float32, "float64": torch.float64}


def _compile_source(program: Program, tag: str) -> dict:
    src = program.source()
    filename = f"<fuzz seed={program.seed} {tag}>"
    linecache.cache[filename] = (len(src), None, src.splitlines(True), filename)
    namespace: dict = {}
    exec(compile(src, filename, "exec"), namespace)  # noqa: S102 - the program under test
    return namespace


class _Observations:
    def __init__(self):
        self.items: list[tuple[str, Any]] = []
        self.raised: BaseException | None = None
        self.where = ""

    def add(self, label: str, value: Any) -> None:
        self.items.append((label, _snapshot(value)))


@dataclass
class _TensorSnapshot:
    value: torch.Tensor
    meta: dict[str, Any]


def _snapshot(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        meta = {
            "shape": tuple(value.shape),
            "dtype": value.dtype,
            "stride": value.stride(),
            "device": value.device.type,
            "requires_grad": value.requires_grad,
            "is_leaf": value.is_leaf,
        }
        return _TensorSnapshot(value.detach().clone(), meta)
    if isinstance(value, (list, tuple)):
        return type(value)(_snapshot(v) for v in value)
    return value


_INIT_LOCK = threading.Lock()


class _World:
    """One compiled version of the program, with its own parameters, inputs, held outputs and pending losses."""

    def __init__(self, program: Program, backend: BackendSpec, ex: Executor | str | None, namespace: dict):
        self.program = program
        self.backend = backend
        self.device = backend.device
        dims = program.dims(backend.scale)
        self.dims = dims
        with _INIT_LOCK, torch.random.fork_rng(devices=[]):  # threads share the generator
            torch.manual_seed(program.seed)
            if program.module:
                self.module = namespace["Fuzzed"](dims["d"], dims["n"], dims["vocab"]).to(self.device)
                target = self.module
                self.fn_params: dict[str, torch.Tensor] = {}
            else:
                self.module = None
                made = namespace["make_tensors"](dims["d"], dims["n"], dims["vocab"])
                self.fn_params = {
                    k: v.detach().to(self.device).requires_grad_(v.requires_grad) for k, v in made.items()
                }
                target = namespace["forward"]
        if ex is None:
            self.fn = thunder.jit(target)
        elif ex == "eager":
            self.fn = target
        elif program.position == "first":
            self.fn = thunder.jit(target, executors=[ex, *thunder.get_default_executors()])
        else:
            self.fn = thunder.jit(target, executors=[*thunder.get_default_executors(), ex])
        self.persistent: dict[tuple, torch.Tensor] = {}
        self.held: dict[str, Any] = {}
        self.pending: list[tuple[str, Any, list, list, dict]] = []
        self.last_inputs: dict[str, torch.Tensor] = {}
        self.previous: dict[int, torch.Tensor] = {}
        self.calls = 0

    # -- tensors

    def named_state(self) -> list[tuple[str, torch.Tensor]]:
        if self.module is not None:
            return [(t.name, getattr(self.module, t.name)) for t in self.program.params]
        return list(self.fn_params.items())

    def _make_input(self, spec: TensorSpec, mode: Mode, layout: str, key: tuple) -> torch.Tensor:
        g = torch.Generator().manual_seed(_seed(self.program.seed, *key))
        d, n, vocab = self.dims["d"], self.dims["n"], self.dims["vocab"]
        batch = self.dims["batches"][mode.batch]
        dtype = _DTYPES[mode.dtype]
        if spec.kind == "I":
            return torch.randperm(n, generator=g)[:batch].to(self.device)
        if spec.kind == "T":
            return torch.randint(0, vocab, (batch,), generator=g).to(self.device)
        if spec.kind == "S":
            return torch.rand((), generator=g).to(dtype) + 0.5  # a CPU scalar tensor, also on CUDA
        shape = {"BD": (batch, d), "D": (d,), "ND": (n, d)}[spec.kind]
        if layout == "transposed" and len(shape) == 2:
            t = torch.randn(shape[::-1], generator=g).to(self.device, dtype).t()
        elif layout == "strided":
            t = torch.randn((*shape[:-1], 2 * shape[-1]), generator=g).to(self.device, dtype)[..., ::2]
        else:
            t = torch.randn(shape, generator=g).to(self.device, dtype)
        return t.requires_grad_(spec.requires_grad)

    def inputs_for(self, step: Step, index: int) -> dict[str, torch.Tensor]:
        args = {}
        for spec in self.program.inputs:
            if spec.persistent or (not step.fresh and spec.kind not in ("I", "T", "S")):
                key = ("persistent", spec.name, step.mode.batch, step.mode.dtype, step.layout)
                if key not in self.persistent:
                    self.persistent[key] = self._make_input(spec, step.mode, step.layout, key)
                args[spec.name] = self.persistent[key]
            else:
                args[spec.name] = self._make_input(spec, step.mode, step.layout, ("call", index, spec.name))
        return args

    # -- steps

    def run(self, step: Step, index: int) -> _Observations:
        obs = _Observations()
        try:
            getattr(self, f"_{step.action}")(step, index, obs)
            self._observe_common(obs)
        except Exception as e:  # noqa: BLE001 - compared with the other world's
            obs.raised = e
            obs.where = "".join(traceback.format_exception(e)[-12:])
        return obs

    def _call(self, step: Step, index: int, obs: _Observations) -> None:
        args = self.inputs_for(step, index)
        call_args = list(args.values())
        if self.module is None:
            call_args += list(self.fn_params.values())
        label = f"c{self.calls}"
        self.calls += 1
        with contextlib.nullcontext() if step.mode.grad else torch.no_grad():
            result = self.fn(*call_args)
        outs = list(result)
        for i, o in enumerate(outs):
            obs.add(f"out{i}", o)
            if isinstance(o, torch.Tensor):
                prev = self.previous.get(i)
                obs.add(
                    f"out{i} equals the previous call's",
                    prev is not None and prev.shape == o.shape and bool(torch.equal(prev, o.detach())),
                )
                self.previous[i] = o.detach().clone()
        # identity and memory sharing with inputs, parameters, held outputs and each other
        named = [(f"input {k}", v) for k, v in args.items()] + [(f"state {k}", v) for k, v in self.named_state()]
        tensors = named + [(f"out{i}", o) for i, o in enumerate(outs) if isinstance(o, torch.Tensor)]
        tensors += [
            (f"held {k}[{i}]", o)
            for k, os in self.held.items()
            for i, o in enumerate(os)
            if isinstance(o, torch.Tensor)
        ]
        obs.add("shared memory", _sharing(tensors))
        obs.add("identity", [next((n for n, t in named if o is t), None) for o in outs])
        for k, v in args.items():
            obs.add(f"input {k} after the call", v)
        self.last_inputs = args
        grads = [(o, None) for o in outs if isinstance(o, torch.Tensor) and o.requires_grad and o.is_floating_point()]
        if step.mode.grad and step.loss != "none" and grads:
            g = torch.Generator().manual_seed(_seed(self.program.seed, "cotangent", index))
            pairs = [(o, torch.randn(o.shape, generator=g).to(o.device, o.dtype)) for o, _ in grads]
            leaves = {k: v for k, v in args.items() if v.requires_grad}
            leaves.update({k: v for k, v in self.named_state() if v.requires_grad})
            if step.form == "sum":
                loss = sum((o * c).sum() for o, c in pairs)
                obs.add("loss", loss)
                entry = (label, loss, [], [], leaves)
            else:
                entry = (label, None, [o for o, _ in pairs], [c for _, c in pairs], leaves)
            if step.loss == "pending":
                self.pending.append(entry)
            else:
                self._backprop(entry, step.loss == "retain", obs)
                if step.loss == "retain":
                    self._backprop(entry, False, obs)
        if step.keep == "hold":
            self.held[label] = outs
        elif step.keep == "mutate":
            self._write_first(outs, step.variant)
        del outs, result

    def _backprop(self, entry, retain: bool, obs: _Observations) -> None:
        label, loss, outs, cots, leaves = entry
        if loss is not None:
            loss.backward(retain_graph=retain)
        else:
            torch.autograd.backward(outs, cots, retain_graph=retain)
        for k, v in leaves.items():
            obs.add(f"grad of {label} {k}", v.grad)

    def _backward(self, step: Step, index: int, obs: _Observations) -> None:
        if not self.pending:
            return
        pos = 0 if step.target == "first" else -1
        entry = self.pending[pos]
        if not step.retain:
            self.pending.pop(pos)
        self._backprop(entry, step.retain, obs)

    def _write_input(self, step: Step, index: int, obs: _Observations) -> None:
        t = self.last_inputs.get(step.target)
        if t is not None:
            _WRITES[step.variant][1](t)
            obs.add(f"input {step.target} after the write", t)

    def _write_output(self, step: Step, index: int, obs: _Observations) -> None:
        self._write_first(self.held.get(step.target, []), step.variant)

    @staticmethod
    def _write_first(outs: Sequence[Any], variant: int) -> None:
        tensors = [o for o in outs if isinstance(o, torch.Tensor) and o.is_floating_point()]
        if tensors:
            _WRITES[variant][1](tensors[0])

    def _zero_grad(self, step: Step, index: int, obs: _Observations) -> None:
        for _, t in self.named_state():
            t.grad = None
        for t in self.persistent.values():
            t.grad = None

    def _train(self, step: Step, index: int, obs: _Observations) -> None:
        self.module.train()

    def _eval(self, step: Step, index: int, obs: _Observations) -> None:
        self.module.eval()

    def _dtype(self, step: Step, index: int, obs: _Observations) -> None:
        self._zero_grad(step, index, obs)
        dtype = _DTYPES[step.target]
        if self.module is not None:
            self.module.to(dtype)
        else:
            for t in self.fn_params.values():
                t.data = t.data.to(dtype)

    def _observe_common(self, obs: _Observations) -> None:
        for label, outs in self.held.items():
            for i, o in enumerate(outs):
                obs.add(f"held output {label}[{i}]", o)
        for name, t in self.named_state():
            obs.add(f"state {name}", t)
            if t.requires_grad:
                obs.add(f"grad of state {name}", t.grad)


def _sharing(tensors: list[tuple[str, Any]]) -> list[tuple[str, str]]:
    """Pairs of labels whose tensors share memory (a storage), in label order."""
    by_storage: dict[int, list[str]] = {}
    for label, t in tensors:
        if isinstance(t, torch.Tensor) and t.numel() > 0:
            by_storage.setdefault(t.untyped_storage().data_ptr(), []).append(label)
    pairs = []
    for labels in by_storage.values():
        pairs += [(a, b) for i, a in enumerate(labels) for b in labels[i + 1 :] if a != b]
    return sorted(pairs)


# -- comparing --------------------------------------------------------------------------------------------------------


@dataclass
class Failure:
    seed: int
    step: int
    label: str
    detail: str
    symptom: str  # a grouping key: what went wrong, with names and numbers taken out
    program: Program = field(repr=False)
    #: Set when plain Thunder is the one that differs (see :func:`_triage`): reported, not counted as a failure.
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


def _normalise(message: str) -> str:
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


_META_KEYS = ("shape", "dtype", "stride", "device", "requires_grad", "is_leaf")


def _compare_value(a: Any, b: Any, mode: str, values_only: bool = False) -> str | None:
    """None when ``a`` (reference) and ``b`` (cudagraphex) agree; mode is exact, close, stats or meta. With
    ``values_only`` a tensor's metadata is not compared."""
    if isinstance(a, _TensorSnapshot) != isinstance(b, _TensorSnapshot):
        return f"reference {_short(a)}, cudagraphex {_short(b)}"
    if not isinstance(a, _TensorSnapshot):
        if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b):
            for i, (x, y) in enumerate(zip(a, b)):
                diff = _compare_value(x, y, mode, values_only)
                if diff:
                    return f"[{i}] {diff}"
            return None
        if isinstance(a, float) and isinstance(b, float) and mode != "exact":
            if mode in ("meta", "stats") or abs(a - b) <= 1e-4 * max(1.0, abs(a)):
                return None
            return f"reference {a}, cudagraphex {b}"
        return None if a == b else f"reference {a!r}, cudagraphex {b!r}"
    for key in () if values_only else _META_KEYS:
        if a.meta[key] != b.meta[key]:
            return f"{key}: reference {a.meta[key]}, cudagraphex {b.meta[key]}"
    x, y = a.value, b.value
    if mode == "meta":
        return None
    if mode == "exact":
        if torch.equal(x.isnan(), y.isnan()) and torch.equal(x.nan_to_num(0.0), y.nan_to_num(0.0)):
            return None
    elif mode == "close":
        if not x.is_floating_point():
            if torch.equal(x, y):
                return None
        elif torch.allclose(x, y, rtol=1e-4, atol=1e-5, equal_nan=True):
            return None
    else:
        return _compare_stats(x, y)
    return f"values differ: {_diff(x, y)}"


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


def _diff(x: torch.Tensor, y: torch.Tensor) -> str:
    try:
        d = (x.double() - y.double()).abs().nan_to_num(float("inf"))
        return f"max abs diff {float(d.max()):.3g} at flat index {int(d.argmax())} of {x.numel()}"
    except Exception:  # noqa: BLE001 - a description only
        return "(not comparable)"


def _short(v: Any) -> str:
    if isinstance(v, _TensorSnapshot):
        return f"tensor{list(v.meta['shape'])}"
    return repr(v)[:60]


def _value_mode(label: str, mode: str) -> str:
    return "exact" if label in ("identity", "shared memory") or "equals the previous" in label else mode


def _compare(program: Program, backend: BackendSpec, index: int, ref: _Observations, got: _Observations):
    mode = backend.compare
    if mode == "close" and program.random:
        mode = "stats"
    for (label, a), (label_b, b) in zip(ref.items, got.items):
        if label != label_b:
            detail = f"observed {label_b!r} instead"
            return Failure(program.seed, index, label, detail, f"{_label_kind(label)}: other observations", program)
        diff = _compare_value(a, b, _value_mode(label, mode))
        if diff:
            what = diff.split(":")[0] if diff.startswith(_META_KEYS) else "values"
            nearly = what == "values" and mode == "exact" and _compare_value(a, b, "close") is None
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
            message = f"{type(e).__name__}: {_normalise(str(e))}"
            if ref.raised is None:
                symptom = f"raises only with cudagraphex: {message}"
            else:
                symptom = f"reference raises {type(ref.raised).__name__}, cudagraphex {message}"
            detail = f"{type(e).__name__}: {str(e)[:400]}\n{_indent(got.where, '    ')}"
        else:
            e = ref.raised
            symptom = f"raises only without cudagraphex: {type(e).__name__}: {_normalise(str(e))}"
            detail = f"{type(e).__name__}: {str(e)[:400]}"
        return Failure(program.seed, index, "exception", detail, symptom, program)
    if len(ref.items) != len(got.items) and ref.raised is None:
        detail = f"{len(ref.items)} observations against {len(got.items)}"
        return Failure(program.seed, index, "observations", detail, "other observations", program)
    return None


# -- running ----------------------------------------------------------------------------------------------------------


@dataclass
class Outcome:
    failures: list[Failure] = field(default_factory=list)
    raised_in_both: list[str] = field(default_factory=list)  # "ExceptionType: message" of runs both rejected
    calls: int = 0
    compilations: int = 0  # Thunder cache misses of both compiled functions


def _lockstep(program: Program, worlds: Sequence[_World], steps: Sequence[Step], seeded: bool):
    """Yields (index, observations of each world) for each step."""
    for index, step in enumerate(steps):
        results = []
        for world in worlds:
            if seeded:
                torch.manual_seed(_seed(program.seed, "step", index))
            results.append(world.run(step, index))
        yield index, results


def _run_pair(program: Program, backend: BackendSpec, ex: CUDAGraphExecutor, seeded: bool) -> Outcome:
    outcome = Outcome()
    try:
        ref = _World(program, backend, None, _compile_source(program, "reference"))
        cgx = _World(program, backend, ex, _compile_source(program, "cudagraphex"))
    except Exception as e:  # noqa: BLE001 - a program the fuzzer should not have built
        outcome.failures.append(Failure(program.seed, -1, "setup", repr(e), f"setup: {type(e).__name__}", program))
        return outcome
    for index, (a, b) in _lockstep(program, (ref, cgx), program.steps, seeded):
        outcome.calls += program.steps[index].action == "call"
        failure = _compare(program, backend, index, a, b)
        if failure is not None:
            outcome.failures.append(failure)
            break
        if a.raised is not None:
            outcome.raised_in_both.append(f"{type(a.raised).__name__}: {_normalise(str(a.raised))}")
            break
    outcome.compilations = thunder.cache_misses(ref.fn) + thunder.cache_misses(cgx.fn)
    return outcome


_MISSING = object()


def _triage(failure: Failure, backend: BackendSpec, ex: CUDAGraphExecutor) -> None:
    """Runs the program eagerly beside cudagraphex up to the failing step. When eager PyTorch agrees with
    cudagraphex on what failed (the same error or none; values within a tolerance, or to the last bit where the
    difference was within one; metadata only for random programs), plain Thunder is the one that differs, and the
    failure is excused. An output's requires_grad is excused also where Thunder with a fusion executor of its own
    agrees with cudagraphex (see :func:`_a_fusion_executor_agrees`)."""
    program = failure.program
    if failure.symptom.startswith("raises only without cudagraphex") and _THUNDER_FUNCTION_VIEW in failure.symptom:
        failure.excused = (
            "an error of Thunder's autograd function, which returns outputs as views of one another; eager and"
            " cudagraphex hand out plain tensors and views, which autograd lets the caller write"
        )
        return
    if failure.step < 0 or (failure.nearly_equal and program.random):
        return
    failure.excused = _eager_verdict(failure, backend, ex)
    if (
        not failure.excused
        and failure.symptom.endswith(": requires_grad")
        and _a_fusion_executor_agrees(failure, backend, ex)
    ):
        failure.excused = (
            "Thunder's grad transform finds no gradient, so Thunder connects outputs to autograd only where its"
            " backward trace is not empty: without a fusion executor an in-place write no forward output needs is"
            " moved into that backward; Thunder with its torch.compile fusion executor loses requires_grad as well"
        )


def _eager_verdict(failure: Failure, backend: BackendSpec, ex: CUDAGraphExecutor) -> str:
    """Why plain Thunder is the one that differs, by eager PyTorch run beside cudagraphex; empty for no verdict."""
    program = failure.program
    try:
        eager = _World(program, backend, "eager", _compile_source(program, "eager"))
        cgx = _World(program, backend, ex, _compile_source(program, "cudagraphex"))
    except Exception:  # noqa: BLE001 - no verdict
        return ""
    steps = program.steps[: failure.step + 1]
    for index, (e, c) in _lockstep(program, (eager, cgx), steps, seeded=not program.threads):
        if e.raised is not None and c.raised is None and _thunder_refuses_later(failure, e.raised):
            return (
                "eager refuses the program (a tensor saved for backward written in place); plain Thunder runs that"
                " write in its backward and refuses a later backward, cudagraphex runs it in the forward"
            )
        if index < failure.step:
            if e.raised is not None or c.raised is not None:
                return ""
            continue
        if failure.label == "exception":  # the same error (type and message), or none
            same = (e.raised is None) == (c.raised is None)
            if same and e.raised is not None:
                same = type(e.raised) is type(c.raised) and _gist(e.raised) == _gist(c.raised)
        else:
            a, b = dict(e.items).get(failure.label, _MISSING), dict(c.items).get(failure.label, _MISSING)
            if a is _MISSING or b is _MISSING:
                return ""
            # a difference within a tolerance is Thunder's only where eager and cudagraphex agree to the last bit
            mode = "meta" if program.random else "exact" if failure.nearly_equal else "close"
            values_only = failure.symptom.endswith(("values", "values (within a tolerance)"))
            same = _compare_value(a, b, _value_mode(failure.label, mode), values_only) is None
        if same:
            return "plain Thunder differs from eager here, and cudagraphex agrees with eager"
    return ""


def _a_fusion_executor_agrees(failure: Failure, backend: BackendSpec, ex: CUDAGraphExecutor) -> bool:
    """Whether Thunder with its torch.compile fusion executor in cudagraphex's place observes what cudagraphex does at
    the failing step.

    Thunder 0.2.6 returns outputs that require grad only when ``split_into_forward_and_backward`` leaves a backward
    trace: its grad transform produces no gradient under ``no_grad``, or where an in-place write may reach an input
    through ``contiguous`` (``x.t().contiguous().t().relu_()``), yet without a fusion executor the split moves that
    write into the backward, and the outputs require grad (a backward that computes nothing, or fails). A fusion
    executor fuses the write with forward outputs, so it stays in the forward and no backward is left.
    """
    from thunder.executors.torch_compile import torch_compile_ex

    program = failure.program
    try:
        fused = _World(program, backend, torch_compile_ex, _compile_source(program, "torch.compile fusion"))
        cgx = _World(program, backend, ex, _compile_source(program, "cudagraphex"))
    except Exception:  # noqa: BLE001 - no verdict
        return False
    steps = program.steps[: failure.step + 1]
    for index, (f, c) in _lockstep(program, (fused, cgx), steps, seeded=not program.threads):
        if f.raised is not None or c.raised is not None:
            return False
        if index == failure.step:
            a, b = dict(f.items).get(failure.label, _MISSING), dict(c.items).get(failure.label, _MISSING)
            return a is not _MISSING and b is not _MISSING and _compare_value(a, b, "meta") is None
    return False


_THUNDER_FUNCTION_VIEW = "Output N of ThunderOutputFunctionBackward is a view"
_SAVED_TENSOR_WRITTEN = "one of the variables needed for gradient computation has been modified by an inplace"


def _thunder_refuses_later(failure: Failure, eager_error: BaseException) -> bool:
    """Whether eager refused the program for a saved tensor written in place, and the difference is that plain Thunder
    refuses it for the same reason at a later step (Thunder 0.2.6 moves such a forward write into its backward)."""
    return (
        failure.label == "exception"
        and _SAVED_TENSOR_WRITTEN in str(eager_error)
        and _SAVED_TENSOR_WRITTEN in failure.detail
    )


def _gist(e: BaseException) -> str:
    """The start of an error message, up to the first detail in brackets."""
    return _normalise(str(e)).split("[")[0][:60]


def check(program: Program, backend: str = "emulate", triage: bool = True) -> Outcome:
    """Runs ``program`` with cudagraphex and with plain Thunder and returns the differences (at most one per
    thread: a run stops at its first difference, or where both raise). With ``triage``, each difference is also
    checked against eager PyTorch (see :func:`_triage`)."""
    spec = BACKENDS[backend]
    ex = executor(backend, program.min_region_size)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.random.fork_rng(devices=[torch.cuda.current_device()] if spec.device == "cuda" else []):
            if not program.threads:
                outcome = _run_pair(program, spec, ex, seeded=True)
            else:
                outcome = _run_threads(program, spec, ex)
            if triage:
                for f in outcome.failures:
                    _triage(f, spec, ex)
    return outcome


def _run_threads(program: Program, spec: BackendSpec, ex: CUDAGraphExecutor) -> Outcome:
    """Two threads, each with its own compiled pair (RNG-free programs only: the threads share the generator)."""
    outcomes: list[Outcome] = [Outcome(), Outcome()]

    def worker(k: int) -> None:
        try:
            outcomes[k] = _run_pair(program, spec, ex, seeded=False)
        except Exception as e:  # noqa: BLE001 - reported as a failure
            f = Failure(program.seed, -1, f"thread {k}", repr(e), f"thread: {type(e).__name__}", program)
            outcomes[k] = Outcome([f])

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    merged = Outcome()
    for o in outcomes:
        merged.failures += o.failures
        merged.raised_in_both += o.raised_in_both
        merged.calls += o.calls
        merged.compilations += o.compilations
    return merged


# -- shrinking --------------------------------------------------------------------------------------------------------


def _without_line(program: Program, i: int) -> Program | None:
    line = program.lines[i]
    later = program.lines[i + 1 :]
    if line.defines and (
        any(line.defines in ln.uses for ln in later)
        or any(re.search(rf"\b{line.defines}\b", o) for o in program.outputs)
    ):
        return None
    return dataclasses.replace(program, lines=program.lines[:i] + later)


def _used(program: Program, name: str) -> bool:
    ref = f"self.{name}" if any(t.name == name and t.role in ("param", "buffer") for t in program.tensors) else name
    return any(ref in ln.uses for ln in program.lines) or any(
        re.search(rf"\b{re.escape(ref)}\b", o) for o in program.outputs
    )


def shrink(failure: Failure, backend: str = "emulate", budget: int = 60) -> Failure:
    """A smaller program (fewer steps, lines, outputs and tensors) that fails with the same symptom."""
    best = failure
    runs = 0

    def attempt(candidate: Program) -> bool:
        nonlocal best, runs
        runs += 1
        fs = check(candidate, backend).failures
        match = [f for f in fs if f.symptom == best.symptom and bool(f.excused) == bool(best.excused)]
        if match:
            best = match[0]
            return True
        return False

    changed = True
    while changed and runs < budget:
        changed = False
        p = best.program
        # steps after the failing one, then each earlier step
        if 0 <= best.step < len(p.steps) - 1 and attempt(dataclasses.replace(p, steps=p.steps[: best.step + 1])):
            changed = True
            continue
        for i in range(len(p.steps) - 1, -1, -1):
            if runs >= budget:
                break
            if attempt(dataclasses.replace(p, steps=p.steps[:i] + p.steps[i + 1 :])):
                changed = True
                break
        if changed:
            continue
        for i in range(len(p.outputs) - 1, -1, -1):
            if len(p.outputs) > 1 and attempt(dataclasses.replace(p, outputs=p.outputs[:i] + p.outputs[i + 1 :])):
                changed = True
                break
        if changed:
            continue
        for i in range(len(p.lines) - 1, -1, -1):
            candidate = _without_line(p, i)
            if candidate is not None and runs < budget and attempt(candidate):
                changed = True
                break
        if changed:
            continue
        targets = {s.target for s in p.steps if s.action == "write_input"}
        for t in p.tensors:
            unused = not _used(p, t.name) and t.name not in targets
            if unused and attempt(dataclasses.replace(p, tensors=[u for u in p.tensors if u is not t])):
                changed = True
                break
        if changed:
            continue
        if p.threads and attempt(dataclasses.replace(p, threads=False)):
            changed = True
            continue
        for i, step in enumerate(p.steps):
            simpler = [
                dataclasses.replace(step, **{k: v})
                for k, v in (("layout", "contiguous"), ("keep", "drop"), ("loss", "none"), ("fresh", True))
                if step.action == "call" and getattr(step, k) != v
            ]
            for s in simpler:
                if runs < budget and attempt(dataclasses.replace(p, steps=[*p.steps[:i], s, *p.steps[i + 1 :]])):
                    changed = True
                    break
            if changed:
                break
    return best


# -- batches and the command line -------------------------------------------------------------------------------------


@dataclass
class BatchResult:
    programs: int = 0
    calls: int = 0
    compilations: int = 0
    seconds: float = 0.0
    failures: list[Failure] = field(default_factory=list)  # excused ones included
    raised_in_both: dict[str, list[int]] = field(default_factory=dict)
    ops: Counter = field(default_factory=Counter)

    @property
    def counted(self) -> list[Failure]:
        return [f for f in self.failures if not f.excused]

    def add(self, program: Program, outcome: Outcome) -> None:
        self.programs += 1
        self.calls += outcome.calls
        self.compilations += outcome.compilations
        self.failures += outcome.failures
        for what in outcome.raised_in_both:
            self.raised_in_both.setdefault(what, []).append(program.seed)
        self.ops.update(set(program.categories))

    def summary(self) -> str:
        excused = len(self.failures) - len(self.counted)
        head = f"{self.programs} programs, {self.calls} calls, {self.compilations} compilations"
        head += f", {len(self.counted)} failing"
        lines = [f"{head} (+{excused} where plain Thunder is the one that differs), {self.seconds:.1f} s"]
        for title, failures in (("failures", self.counted), ("plain Thunder differs", self.failures)):
            if title != "failures":
                failures = [f for f in failures if f.excused]
            if failures:
                lines.append(f"{title} by symptom:")
            for symptom, n in Counter(f.symptom for f in failures).most_common():
                seeds = [f.seed for f in failures if f.symptom == symptom][:10]
                lines.append(f"  {n:4d}  {symptom}  (seeds {' '.join(map(str, seeds))})")
        if self.raised_in_both:
            lines.append("raised in both (programs that Thunder itself rejects, or legitimate errors):")
            for what, seeds in sorted(self.raised_in_both.items(), key=lambda kv: -len(kv[1]))[:10]:
                lines.append(f"  {len(seeds):4d}  {what}  (seeds {' '.join(map(str, seeds[:6]))})")
        lines.append("programs using each op: " + ", ".join(f"{k} {v}" for k, v in sorted(self.ops.items())))
        return "\n".join(lines)


def _check_seed(args: tuple[int, str]) -> tuple[Program, Outcome]:
    seed, backend = args
    program = generate(seed)
    return program, check(program, backend)


def _worker_init() -> None:
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")


def run_batch(seeds: Iterable[int], backend: str = "emulate", workers: int = 1, on_failure=None) -> BatchResult:
    """Generates and checks one program per seed. ``workers`` > 1 forks that many processes (CPU replay backend
    only, and only while CUDA is not initialised in this process)."""
    result = BatchResult()
    start = time.perf_counter()
    tasks = [(seed, backend) for seed in seeds]
    parallel = workers > 1 and backend == "emulate" and not torch.cuda.is_initialized()
    with contextlib.ExitStack() as stack:
        if parallel:
            pool = stack.enter_context(
                ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork"), initializer=_worker_init)
            )
            results = pool.map(_check_seed, tasks)
        else:
            results = map(_check_seed, tasks)
        for n, (program, outcome) in enumerate(results, 1):
            result.add(program, outcome)
            for f in outcome.failures:
                if on_failure is not None:
                    on_failure(f)
            if not parallel and n % 25 == 0:
                gc.collect()
    result.seconds = time.perf_counter() - start
    return result


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.fuzzing", description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=sorted(BACKENDS), default="emulate")
    parser.add_argument("--count", type=int, default=200)
    parser.add_argument("--start", type=int, default=0)
    parser.add_argument("--seed", type=int, action="append", help="check these seeds (repeatable) instead")
    parser.add_argument("--workers", type=int, default=1, help="processes (CPU replay backend only)")
    parser.add_argument("--show", type=int, metavar="SEED", help="print the program of this seed and exit")
    parser.add_argument("--shrink", action="store_true", help="shrink each failing program before printing it")
    parser.add_argument("--brief", action="store_true", help="one line per failure, without the program")
    args = parser.parse_args(argv)
    if args.backend == "cuda" and not torch.cuda.is_available():
        parser.error("--backend cuda needs a CUDA GPU")
    if args.show is not None:
        print(generate(args.show).describe())
        return 0
    seeds = args.seed or range(args.start, args.start + args.count)

    def on_failure(f: Failure) -> None:
        if args.shrink:
            f = shrink(f, args.backend)
        print(f.report(full=not args.brief), flush=True)

    result = run_batch(seeds, args.backend, args.workers, on_failure)
    print(result.summary())
    return 1 if result.counted else 0


if __name__ == "__main__":
    sys.exit(main())
