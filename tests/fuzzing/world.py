"""One compiled program and its observable state: runs steps and snapshots what a caller can see."""

from __future__ import annotations

import contextlib
import linecache
import threading
import traceback
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import thunder
import torch
from thunder.extend import Executor

from cudagraphex import CUDAGraphExecutor, graph_step
from tests.fuzzing.programs import WRITES, Mode, Program, Step, TensorSpec


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


def derived_seed(*key: Any) -> int:
    return zlib.crc32(repr(key).encode())


_DTYPES = {"float32": torch.float32, "float64": torch.float64}


def compile_source(program: Program, tag: str) -> dict:
    src = program.source()
    filename = f"<fuzz seed={program.seed} {tag}>"
    linecache.cache[filename] = (len(src), None, src.splitlines(True), filename)
    namespace: dict = {}
    exec(compile(src, filename, "exec"), namespace)  # noqa: S102 - the program under test
    return namespace


class Observations:
    def __init__(self):
        self.items: list[tuple[str, Any]] = []
        self.raised: BaseException | None = None
        self.where = ""

    def add(self, label: str, value: Any) -> None:
        self.items.append((label, _snapshot(value)))


@dataclass
class TensorSnapshot:
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
        return TensorSnapshot(value.detach().clone(), meta)
    if isinstance(value, (list, tuple)):
        return type(value)(_snapshot(v) for v in value)
    return value


_INIT_LOCK = threading.Lock()


class World:
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
        defaults = [*thunder.get_default_executors()]
        if program.fuser:
            from thunder.executors.torch_compile import torch_compile_ex

            if ex is not torch_compile_ex:
                defaults.insert(0, torch_compile_ex)
        if ex is None:
            self.fn = thunder.jit(target, executors=defaults)
        elif ex == "eager":
            self.fn = target
        elif program.position == "first":
            self.fn = thunder.jit(target, executors=[ex, *defaults])
        else:
            self.fn = thunder.jit(target, executors=[*defaults, ex])
        #: What a call runs: the compiled program, or (whole-step programs) one step of it, through ``graph_step`` where
        #: the program is compiled with cudagraphex.
        self.step = self._whole_step
        self.optimizer = None
        if program.whole_step:
            state = self.module if self.module is not None else self._state_module()
            trainable = [p for p in state.parameters() if p.requires_grad]
            if program.optimizer != "none" and trainable:
                momentum = 0.9 if program.optimizer == "momentum" else 0.0
                self.optimizer = torch.optim.SGD(trainable, lr=0.1, momentum=momentum)
            sizes = [max(dims["batches"])] if program.bucketed else None
            if isinstance(ex, CUDAGraphExecutor):
                optimizers = [self.optimizer] if self.optimizer is not None else []
                self.step = graph_step(
                    self._whole_step,
                    modules=[state],
                    optimizers=optimizers,
                    warmup_calls=1,
                    backend=backend.name,
                    capture_sizes=sizes,
                )
            if program.bucketed:
                if self.module is not None:
                    self.module.eval()  # serving: dropout that follows the module's mode draws nothing
                self._prepare(sizes[0], graphed=isinstance(ex, CUDAGraphExecutor))
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
        g = torch.Generator().manual_seed(derived_seed(self.program.seed, *key))
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

    def run(self, step: Step, index: int) -> Observations:
        obs = Observations()
        try:
            getattr(self, f"_{step.action}")(step, index, obs)
            self._observe_common(obs)
        except Exception as e:  # noqa: BLE001 - compared with the other world's
            obs.raised = e
            obs.where = "".join(traceback.format_exception(e)[-12:])
        return obs

    def _prepare(self, size: int, graphed: bool) -> None:
        """Captures the bucketed step at ``size`` up front (``StepGraph.prepare``: two calls of that size); a world
        without the step graph makes the same two calls."""
        mode = Mode(batch=self.dims["batches"].index(size), grad=False)
        example = [self._make_input(spec, mode, "contiguous", ("prepare", spec.name)) for spec in self.program.inputs]
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            torch.manual_seed(derived_seed(self.program.seed, "prepare"))
            if graphed:
                self.step.prepare(False, False, *example)
            else:
                for _ in range(2):
                    self._whole_step(False, False, *example)

    def _state_module(self) -> torch.nn.Module:
        """A function program's parameters and buffers as a module's (a whole step reads them as its state, not as
        arguments, which it would copy into buffers)."""
        state = torch.nn.Module()
        for name, t in list(self.fn_params.items()):
            if t.requires_grad:
                t = self.fn_params[name] = torch.nn.Parameter(t)
                state.register_parameter(name, t)
            else:
                state.register_buffer(name, t)
        return state

    def _whole_step(self, backward: bool, direct: bool, *inputs: torch.Tensor) -> tuple[tuple, torch.Tensor | None]:
        """One call, its backward and the program's optimizer step at once, with cotangents made on the device from
        the outputs (a host-made one would keep the step from being captured). Returns the outputs and the loss,
        detached, as a step must."""
        outs = list(self.fn(*inputs, *self.fn_params.values()))
        pairs = [
            (o, o.detach().cos() if self.program.cotangents == "cos" else torch.ones_like(o))
            for o in outs
            if isinstance(o, torch.Tensor) and o.requires_grad and o.is_floating_point()
        ]
        loss = None
        if backward and pairs:
            if direct:
                torch.autograd.backward([o for o, _ in pairs], [c for _, c in pairs])
            else:
                loss = sum((o * c).sum() for o, c in pairs)
                loss.backward()
                loss = loss.detach()
            if self.optimizer is not None:
                self.optimizer.step()
        if self.program.bucketed:  # new tensors, so that a step returning its input (or a view) is padded too
            return tuple(o.detach().clone() if isinstance(o, torch.Tensor) else o for o in outs), loss
        return tuple(o.detach() if isinstance(o, torch.Tensor) else o for o in outs), loss

    def _call(self, step: Step, index: int, obs: Observations) -> None:
        if self.program.whole_step:
            self._step_call(step, index, obs)
            return
        args = self.inputs_for(step, index)
        call_args = list(args.values())
        if self.module is None:
            call_args += list(self.fn_params.values())
        label = f"c{self.calls}"
        self.calls += 1
        with contextlib.nullcontext() if step.mode.grad else torch.no_grad(), self._autocast(step.mode):
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
        named = self._named(args)
        obs.add("shared memory", self._shared_memory(named, outs))
        obs.add("identity", [next((n for n, t in named if o is t), None) for o in outs])
        for k, v in args.items():
            obs.add(f"input {k} after the call", v)
        self.last_inputs = args
        floats = [o for o in outs if isinstance(o, torch.Tensor) and o.is_floating_point()]
        if step.mode.grad and step.loss != "none" and any(o.requires_grad for o in floats):
            g = torch.Generator().manual_seed(derived_seed(self.program.seed, "cotangent", index))
            # One draw per floating-point output, so that worlds that differ in which outputs require grad (Thunder
            # marks some that eager does not) give the same output the same cotangent.
            drawn = [(o, torch.randn(o.shape, generator=g).to(o.device, o.dtype)) for o in floats]
            pairs = [(o, c) for o, c in drawn if o.requires_grad]
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
        self._keep(step, label, outs)
        del outs, result

    def _step_call(self, step: Step, index: int, obs: Observations) -> None:
        """A call of a whole-step program: what the caller sees of the step, its results' memory sharing included (a
        step whose results share memory with its arguments, its state or each other is run as is)."""
        args = self.inputs_for(step, index)
        label = f"c{self.calls}"
        self.calls += 1
        backward = step.mode.grad and step.loss != "none"
        with contextlib.nullcontext() if step.mode.grad else torch.no_grad(), self._autocast(step.mode):
            outs, loss = self.step(backward, step.form == "direct", *args.values())
        for i, o in enumerate(outs):
            obs.add(f"out{i}", o)
        obs.add("loss", loss)
        obs.add("shared memory", self._shared_memory(self._named(args), outs))
        for k, v in args.items():
            obs.add(f"input {k} after the call", v)
            if v.requires_grad:
                obs.add(f"grad of {label} input {k}", v.grad)
        self.last_inputs = args
        self._keep(step, label, outs)

    def _autocast(self, mode: Mode) -> torch.autocast:
        return torch.autocast(torch.device(self.device).type, dtype=torch.bfloat16, enabled=mode.autocast)

    def _named(self, args: dict[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
        return [(f"input {k}", v) for k, v in args.items()] + [(f"state {k}", v) for k, v in self.named_state()]

    def _shared_memory(self, named: list, outs: Sequence[Any]) -> list[tuple[str, str]]:
        """Pairs of labels, among the call's inputs and state (``named``), its outputs and the held outputs, whose
        tensors share memory."""
        held = [(f"held {k}[{i}]", o) for k, os in self.held.items() for i, o in enumerate(os)]
        return _sharing(named + [(f"out{i}", o) for i, o in enumerate(outs)] + held)

    def _keep(self, step: Step, label: str, outs: Sequence[Any]) -> None:
        """Holds the call's outputs across later calls, or writes into the first of them, as the step says."""
        if step.keep == "hold":
            self.held[label] = list(outs)
        elif step.keep == "mutate":
            self._write_first(outs, step.variant)

    def _backprop(self, entry, retain: bool, obs: Observations) -> None:
        label, loss, outs, cots, leaves = entry
        if loss is not None:
            loss.backward(retain_graph=retain)
        else:
            torch.autograd.backward(outs, cots, retain_graph=retain)
        for k, v in leaves.items():
            obs.add(f"grad of {label} {k}", v.grad)

    def _backward(self, step: Step, index: int, obs: Observations) -> None:
        if not self.pending:
            return
        pos = 0 if step.target == "first" else -1
        entry = self.pending[pos]
        if not step.retain:
            self.pending.pop(pos)
        self._backprop(entry, step.retain, obs)

    def _write_input(self, step: Step, index: int, obs: Observations) -> None:
        t = self.last_inputs.get(step.target)
        if t is not None:
            WRITES[step.variant][1](t)
            obs.add(f"input {step.target} after the write", t)

    def _write_output(self, step: Step, index: int, obs: Observations) -> None:
        self._write_first(self.held.get(step.target, []), step.variant)

    @staticmethod
    def _write_first(outs: Sequence[Any], variant: int) -> None:
        tensors = [o for o in outs if isinstance(o, torch.Tensor) and o.is_floating_point()]
        if tensors:
            WRITES[variant][1](tensors[0])

    def _zero_grad(self, step: Step, index: int, obs: Observations) -> None:
        for _, t in self.named_state():
            t.grad = None
        for t in self.persistent.values():
            t.grad = None

    def _train(self, step: Step, index: int, obs: Observations) -> None:
        self.module.train()

    def _eval(self, step: Step, index: int, obs: Observations) -> None:
        self.module.eval()

    def _dtype(self, step: Step, index: int, obs: Observations) -> None:
        self._zero_grad(step, index, obs)
        dtype = _DTYPES[step.target]
        if self.module is not None:
            self.module.to(dtype)
        else:
            for t in self.fn_params.values():
                t.data = t.data.to(dtype)

    def _observe_common(self, obs: Observations) -> None:
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


def lockstep(program: Program, worlds: Sequence[World], steps: Sequence[Step], seeded: bool):
    """Yields (index, observations of each world) for each step."""
    for index, step in enumerate(steps):
        results = []
        for world in worlds:
            if seeded:
                torch.manual_seed(derived_seed(program.seed, "step", index))
            results.append(world.run(step, index))
        yield index, results


#: How eager's autograd refuses a backward whose saved tensor was written in place since.
SAVED_TENSOR_WRITTEN = "one of the variables needed for gradient computation has been modified by an inplace"


def raised_first_at_the_last(program: Program, world: World, steps: Sequence[Step]) -> BaseException | None:
    """What ``world`` raises at the last of ``steps``, where it raised at none before; None where it raises nowhere,
    or earlier."""
    for index, (observed,) in lockstep(program, (world,), steps, seeded=not program.threads):
        if observed.raised is not None:
            return observed.raised if index == len(steps) - 1 else None
    return None


def eager_refuses_and_rewritten_runs(
    program: Program, rewritten: Program, tag: str, backend: BackendSpec, ex: Executor, steps: Sequence[Step], why: str
) -> list[tuple[Observations, Observations]] | None:
    """Where eager refuses ``program`` at the last of ``steps``, and at none before, with ``why`` in its error: what
    ``rewritten`` run eagerly (``tag`` names its source) and ``program`` run with ``ex`` observe at each step, where
    neither raises; None otherwise, or where one does not compile."""
    try:
        eager = World(program, backend, "eager", compile_source(program, "eager"))
        rewritten_eager = World(rewritten, backend, "eager", compile_source(rewritten, tag))
        compiled = World(program, backend, ex, compile_source(program, "cudagraphex"))
    except Exception:  # noqa: BLE001 - no verdict
        return None
    refused = raised_first_at_the_last(program, eager, steps)
    if refused is None or why not in str(refused):
        return None
    observed = []
    for _, (r, c) in lockstep(program, (rewritten_eager, compiled), steps, seeded=not program.threads):
        if r.raised is not None or c.raised is not None:
            return None
        observed.append((r, c))
    return observed
