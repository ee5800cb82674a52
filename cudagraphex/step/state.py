"""The state of a whole step (see ``cudagraphex.step.graph``): the slots where its tensors live, their guard inputs, and
the check for host work that keeps a step out of a graph.

Invariants
==========
``Slots.tensors()`` reads every slot in one fixed order (parameters, buffers, gradients, optimizer state), enumerated
once per registration generation: a module of a step's module tree registering a parameter, buffer or submodule bumps
the generation (global registration hooks that look the module up among the watched ones), and so does an optimizer
whose state or param groups change shape (``stale``). A registration into any other module (a forward that slices a
``ModuleList`` builds a new container) bumps nothing. Thunder's interpreter runs the hooks as opaque calls: traced,
they would become part of a compiled function's prologue. Only gradient and buffer slots are ever reassigned by
cudagraphex, and only to the tensor they held before the step.
"""

from __future__ import annotations

import functools
import operator
import threading
import weakref
from collections.abc import Iterable
from typing import Any

import torch
from thunder.core.interpreter import make_opaque
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from cudagraphex.step.rows import on_shapes_only

__all__ = [
    "HostWork",
    "Slots",
    "hyperparameter_change",
    "is_tensor",
    "keep_slots",
    "listed",
    "same_hyperparameters",
    "state_layout",
    "unsettled",
]

#: Bumped whenever a watched module registers a parameter, buffer or submodule: slots are then enumerated again.
_registrations = [0]
#: id -> weak reference of every module in the module tree of a step's slots.
_watched: dict[int, weakref.ref] = {}
#: Reentrant: a weak reference's callback (``_unwatch``) can run in a collection that ``_watch`` triggers.
_lock = threading.RLock()
_hooks: list[Any] = []


@make_opaque
def _registered(module: torch.nn.Module, *_args: Any) -> None:
    ref = _watched.get(id(module))
    if ref is not None and ref() is module:
        _registrations[0] += 1


def _unwatch(key: int, ref: weakref.ref) -> None:
    with _lock:
        if _watched.get(key) is ref:
            del _watched[key]


def _watch(modules: Iterable[torch.nn.Module]) -> None:
    """Makes registrations into ``modules`` bump the generation (installing the global hooks on first use)."""
    with _lock:
        if not _hooks:
            nn_module = torch.nn.modules.module
            _hooks.append(nn_module.register_module_parameter_registration_hook(_registered))
            _hooks.append(nn_module.register_module_buffer_registration_hook(_registered))
            _hooks.append(nn_module.register_module_module_registration_hook(_registered))
        for m in modules:
            ref = _watched.get(id(m))
            if ref is None or ref() is not m:
                _watched[id(m)] = weakref.ref(m, functools.partial(_unwatch, id(m)))


_grad_of = operator.attrgetter("grad")
_training_of = operator.attrgetter("training")


class Slots:
    """The step's state: where each tensor a replay reads or writes lives in Python, enumerated once per registration
    generation. ``tensors()`` reads every slot in a fixed order; ``put`` sets one."""

    def __init__(self, modules: list[torch.nn.Module], optimizers: list[torch.optim.Optimizer]) -> None:
        self.modules = modules
        self.optimizers = optimizers
        self.generation = _registrations[0]
        self.submodules = list(dict.fromkeys(s for m in modules for s in m.modules()))
        _watch(self.submodules)
        params = [p for m in self.submodules for p in m._parameters.values() if p is not None]
        params += [p for opt in optimizers for g in opt.param_groups for p in g["params"]]
        self.params = list(dict.fromkeys(params))
        #: (module, buffer name) of every buffer.
        self.buffer_slots = [(m, n) for m in self.submodules for n, b in m._buffers.items() if b is not None]
        self.states = [opt.state for opt in optimizers]
        #: Each optimizer's per-parameter state dicts, in its state's order (read without hashing parameters).
        self.state_dicts = [list(st.values()) for st in self.states]
        entries = [(d, k) for dicts in self.state_dicts for d in dicts for k in d if is_tensor(d[k])]
        self.entry_dicts = [d for d, _ in entries]
        self.entry_keys = [k for _, k in entries]
        self.num_params = len(self.params)
        self.num_buffers = len(self.buffer_slots)
        self.num_state_values = sum(len(d) for dicts in self.state_dicts for d in dicts)
        self.group_sizes = [len(g["params"]) for opt in optimizers for g in opt.param_groups]

    def stale(self) -> bool:
        """Whether a registration happened, or an optimizer's state or param groups changed, since the slots were
        enumerated."""
        if _registrations[0] != self.generation:
            return True
        for opt, st, dicts in zip(self.optimizers, self.states, self.state_dicts, strict=True):
            if opt.state is not st or len(st) != len(dicts) or not all(map(operator.is_, st.values(), dicts)):
                return True
        if sum(sum(map(len, dicts)) for dicts in self.state_dicts) != self.num_state_values:
            return True
        return [len(g["params"]) for opt in self.optimizers for g in opt.param_groups] != self.group_sizes

    def tensors(self) -> list[torch.Tensor | None]:
        """Parameters, buffers, gradients, optimizer state, in that order."""
        params = self.params
        return [
            *params,
            *(m._buffers[n] for m, n in self.buffer_slots),
            *map(_grad_of, params),
            *map(operator.getitem, self.entry_dicts, self.entry_keys),
        ]

    def grad_index(self, i: int) -> int | None:
        g = i - self.num_params - self.num_buffers
        return g if 0 <= g < self.num_params else None

    def put(self, i: int, value: torch.Tensor | None) -> None:
        """Sets slot ``i`` (a gradient or a buffer; parameters and optimizer state are not reassigned)."""
        g = self.grad_index(i)
        if g is not None:
            self.params[g].grad = value
            return
        b = i - self.num_params
        if 0 <= b < self.num_buffers:
            module, name = self.buffer_slots[b]
            module._buffers[name] = value
            return
        raise AssertionError(f"slot {i} is not reassigned")

    def reassignable(self, i: int) -> bool:
        return self.num_params <= i < 2 * self.num_params + self.num_buffers

    def modes(self) -> tuple:
        """Grad mode, autocast, and every module's training flag: a different one needs another graph."""
        return (
            torch.is_grad_enabled(),
            _autocast("cuda"),
            _autocast("cpu"),
            tuple(map(_training_of, self.submodules)),
        )

    def hyperparameters(self) -> list[list[tuple[str, Any]]]:
        return [[(k, v) for k, v in g.items() if k != "params"] for opt in self.optimizers for g in opt.param_groups]


def _autocast(device_type: str) -> torch.dtype | None:
    """The autocast dtype of ``device_type``, None where autocast is off: a disabled ``torch.autocast`` context still
    sets the dtype, which then changes nothing."""
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None


def is_tensor(x: Any) -> bool:
    return isinstance(x, torch.Tensor)


def hyperparameter_change(now: list, captured: list) -> str | None:
    """How the optimizers' hyperparameters ``now`` differ from ``captured`` (``Slots.hyperparameters``): numbers and
    other Python values by type and value, tensors by identity; None where they do not."""
    if len(now) != len(captured):
        return f"the optimizers have {len(now)} param groups instead of {len(captured)}"
    for group, (gn, gc) in enumerate(zip(now, captured, strict=True)):
        if [k for k, _ in gn] != [k for k, _ in gc]:
            return f"param group {group}'s hyperparameters changed names"
        for (key, vn), (_, vc) in zip(gn, gc, strict=True):
            if is_tensor(vn) or is_tensor(vc):
                if vn is not vc:
                    return f"param group {group}'s {key} is another tensor"
            elif type(vn) is not type(vc) or vn != vc:
                return (
                    f"param group {group}'s {key} changed from {vc!r} to {vn!r} (a value that changes every step "
                    f"belongs in a tensor, such as lr=torch.tensor(...), which schedulers update in place)"
                )
    return None


def same_hyperparameters(now: list, captured: list) -> bool:
    return hyperparameter_change(now, captured) is None


class HostWork(TorchDispatchMode):
    """Finds ops a graph cannot replay: ``.item()``, and ops on CPU tensors when the graph is on a GPU (not those on
    fake or meta tensors alone, which run no kernel)."""

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        # Without this, torch.compile'd code that runs under the mode (Thunder's torch_compile_ex fusions) is
        # disabled for good: Dynamo skips a frame under a dispatch mode and never compiles it again.
        return True

    def __init__(self, device_type: str) -> None:
        super().__init__()
        self.device_type = device_type
        self.found: str | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.found is None:
            if func is torch.ops.aten._local_scalar_dense.default:
                self.found = "reads a device value on the host (.item() or a Python conversion of a tensor)"
            elif self.device_type != "cpu" and "attention" not in func.__name__ and not on_shapes_only(args, kwargs):
                # Attention ops are exempt: their CPU tensors are dropout RNG state, in device memory when captured.
                for t in pytree.tree_leaves((args, kwargs)):
                    if is_tensor(t) and t.device.type == "cpu":
                        self.found = f"runs {func} on a CPU tensor (a non-capturable optimizer, or a CPU scalar tensor)"
                        break
        return func(*args, **kwargs)


def state_layout(tensors: list) -> tuple:
    """Which slots hold a tensor: a gradient that appears or disappears changes what a graph reads and writes."""
    return tuple(t is None for t in tensors)


def keep_slots(slots: Slots, before: list, *, restore: bool = False) -> None:
    """Gives every gradient and buffer slot whose tensor the step replaced its tensor from ``before`` back, with the
    new value copied in (see "Slots keep their tensors" in ``cudagraphex.step.graph``). A slot that was empty, that the
    step emptied, or whose new tensor has another layout keeps what the step left. With ``restore``, every such slot
    gets its old tensor back unchanged (a failed capture, whose device work never ran)."""
    after = slots.tensors()
    with torch.no_grad():
        for i, (old, new) in enumerate(zip(before, after, strict=True)):
            if old is None or new is old or not slots.reassignable(i):
                continue
            if not restore:
                if new is None or new.shape != old.shape or new.dtype != old.dtype or new.stride() != old.stride():
                    continue
                old.copy_(new)
            slots.put(i, old)


def unsettled(before: list, after: list) -> str:
    """Why a graph captured from ``before`` is not valid for ``after`` (empty if it is): slots that changed address."""
    moved = sum(
        1
        for a, b in zip(before, after, strict=True)
        if (a is None) != (b is None) or (a is not None and b is not None and a.data_ptr() != b.data_ptr())
    )
    return f"{moved} slot(s)" if moved else ""


def listed(name: str, value: object, kind: type) -> list:
    """``value``, one ``kind`` object or an iterable of them, as a list; raises TypeError for anything else. One
    module is taken whole, not as its children (an ``nn.Sequential`` is iterable too)."""
    if isinstance(value, kind):
        return [value]
    if not isinstance(value, Iterable):
        raise TypeError(f"{name} must be a {kind.__qualname__} or an iterable of them, got {type(value).__name__}")
    items = list(value)
    for item in items:
        if not isinstance(item, kind):
            raise TypeError(f"{name} must be {kind.__qualname__} objects, got {type(item).__name__}")
    return items
