"""The programs the fuzzer generates: tensors, lines of code, call steps and modes."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

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
    """What decides a Thunder cache entry: batch size (an index into ``Program.batches``), dtype, grad, training, and
    whether the call runs under ``torch.autocast`` to bfloat16."""

    batch: int = 0
    dtype: str = "float32"
    grad: bool = True
    training: bool = True
    autocast: bool = False

    def describe(self) -> str:
        grad = "grad" if self.grad else "no_grad"
        flags = f"{'' if self.training else ' eval'}{' autocast' if self.autocast else ''}"
        return f"B#{self.batch} {self.dtype} {grad}{flags}"


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
            keep = f"mutate ({WRITES[self.variant][0]})" if self.keep == "mutate" else self.keep
            parts = [self.mode.describe(), self.layout, "fresh" if self.fresh else "same inputs", keep]
            if self.loss != "none":
                parts.append(f"loss={self.loss}/{self.form}")
            return "call " + ", ".join(parts)
        if self.action == "backward":
            return f"backward {self.target} pending" + (" retain_graph" if self.retain else "")
        if self.action in ("write_input", "write_output"):
            return f"{self.action} {self.target} ({WRITES[self.variant][0]})"
        if self.action == "dtype":
            return f"dtype {self.target}"
        return self.action


#: How write_input and write_output steps write: (description, function of the tensor).
WRITES = (
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
    #: Each call is one whole step (forward, then backward at once) run through ``graph_step`` (see ``as_whole_steps``).
    whole_step: bool = False
    #: What a whole step ends with: "none", "sgd" or "momentum" (an SGD step over the trainable parameters).
    optimizer: str = "none"
    #: A whole step's cotangent of each output: "cos" (of the output as the forward left it) or "ones".
    cotangents: str = "cos"
    #: A serving step with batch-size buckets (see ``as_bucketed_steps``).
    bucketed: bool = False
    #: Thunder's torch.compile executor runs in both compiled functions, after cudagraphex where it comes first.
    fuser: bool = False

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

    def as_whole_steps(self) -> Program:
        """The program with each call made one whole step: a backward runs in the call that made its loss (pending and
        retained losses become immediate, backward steps go), in one thread, and its inputs are data that requires no
        grad (an argument that requires grad keeps a step from being captured). A third of the steps end with an SGD
        step, a third with SGD with momentum (its state appears at the first step)."""
        steps = [
            dataclasses.replace(s, loss="now") if s.loss in ("pending", "retain") else s
            for s in self.steps
            if s.action != "backward"
        ]
        tensors = [
            t if t.role in ("param", "buffer") else dataclasses.replace(t, requires_grad=False) for t in self.tensors
        ]
        optimizer = ("none", "sgd", "momentum")[self.seed // 4 % 3]
        return dataclasses.replace(
            self, tensors=tensors, steps=steps, threads=False, whole_step=True, optimizer=optimizer
        )

    def with_fuser(self) -> Program:
        """The program with Thunder's torch.compile executor in both compiled functions (``fuser``), in one thread:
        torch.fx marks that it is tracing in a process-global flag, so while one thread's Inductor compiles, another
        thread's call of a function compiled by torch.compile raises ("using FX to symbolically trace a
        dynamo-optimized function")."""
        return dataclasses.replace(self, fuser=True, threads=False)

    def as_bucketed_steps(self) -> Program | None:
        """The program as a serving step with batch-size buckets: whole steps without backward or optimizer, a module
        in eval mode, returning copies of its outputs, through ``graph_step(capture_sizes=[its larger batch])``, so
        that calls of its smaller batch replay that graph padded where its rows are independent. None where an input
        does not carry the batch along dim 0."""
        if any(t.kind not in ("BD", "B1", "T", "S") for t in self.inputs):
            return None
        whole = self.as_whole_steps()
        steps = [
            dataclasses.replace(s, mode=dataclasses.replace(s.mode, grad=False), loss="none") if s.mode else s
            for s in whole.steps
        ]
        return dataclasses.replace(whole, steps=steps, optimizer="none", bucketed=True)

    def describe(self) -> str:
        kinds = ", ".join(f"{t.name}:{t.kind}{' rg' if t.requires_grad else ''}" for t in self.inputs)
        steps_as = (
            " bucketed" if self.bucketed else f" whole-step optimizer={self.optimizer}" if self.whole_step else ""
        )
        head = (
            f"seed={self.seed} {'module' if self.module else 'function'} cudagraphex {self.position} "
            f"min_region_size={self.min_region_size} width={self.width} batches={self.batches}"
            f"{' threads' if self.threads else ''}{steps_as}{' torch.compile' if self.fuser else ''}"
            f"\ninputs: {kinds}\nops: {' '.join(self.categories)}"
        )
        steps = "\n".join(f"  {i:2d} {s.describe()}" for i, s in enumerate(self.steps))
        return f"{head}\n{self.source()}steps:\n{steps}"
