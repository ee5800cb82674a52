"""Draws a random program's body, line by line, from a weighted pool of ops."""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import ClassVar

from tests.fuzzing.programs import FLOAT_KINDS, Line, TensorSpec


@dataclass
class _Value:
    name: str
    kind: str
    intermediate: bool = False  # computed by the program, not a view of an input or parameter
    base: str | None = None  # the input or parameter it is (or is a view of)
    expanded: bool = False  # a broadcast view: never written in place
    requires_grad: bool = False  # a leaf input or parameter that requires grad (or a view of one)


class Builder:
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
