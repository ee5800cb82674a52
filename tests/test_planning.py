"""Planning: which symbols enter graphs and why not, region bounds, static inputs by identity, and
rematerialization between graphs."""

from __future__ import annotations

import dataclasses

import pytest
import thunder
import thunder.torch as ltorch
import torch
from thunder.core import prims
from thunder.core.proxies import TensorProxy

import cudagraphex.executor as executor_module
import cudagraphex.planning.regions as regions_module
from benchmarks.models import GPT, GPTConfig
from cudagraphex import CUDAGraphExecutor
from cudagraphex.planning.regions import RegionSpec
from cudagraphex.planning.rematerialization import not_recomputable, refused_rematerialization
from cudagraphex.planning.static_inputs import InputKind
from tests.helpers import (
    assert_grads_close,
    emulated,
    graphs,
    jit,
    regions,
    replays,
    small_gpt,
    square_written_by_its_own_mul,
    twin,
    with_item,
)


def test_item_splits_the_trace_and_records_why():
    jf = jit(with_item, emulated)
    for _ in range(3):
        x = torch.randn(8)
        torch.testing.assert_close(jf(x), with_item(x))
    rs = regions(jf, emulated)
    assert len(rs) == 2
    breaks = [b for _, bs, _ in graphs(jf, emulated).traces for b in bs if not b.structural]
    (item_break,) = [b for b in breaks if b.reason == "reads a device value on the host"]
    assert item_break.source is not None and item_break.source.startswith(with_item.__code__.co_filename)
    # the multiplication by the host number uses it, so it stays out too
    assert any("host value" in b.reason for b in breaks)
    assert all(len(r.instances) == 1 for r in rs) and replays(jf, emulated) >= 2


def test_regions_below_min_region_size_stay_eager():
    ex = CUDAGraphExecutor("cudagraphex_min5", backend="emulate", min_region_size=5)

    def f(x):
        return (x * 2).sin()

    jf = jit(f, ex)
    x = torch.randn(4)
    torch.testing.assert_close(jf(x), f(x))
    assert regions(jf, ex) == []
    (trace_breaks,) = [bs for _, bs, _ in graphs(jf, ex).traces]
    assert any("min_region_size=5" in b.reason for b in trace_breaks)


def test_can_fuse_override_keeps_symbols_out():
    class NoSin(CUDAGraphExecutor):
        def can_fuse(self, bsym):
            return "sin" not in bsym.sym.name and super().can_fuse(bsym)

    ex = NoSin("cudagraphex_nosin", backend="emulate")

    def f(x):
        y = x * 2 + 1
        return torch.sin(y) * 3 - 1

    jf = jit(f, ex)
    for _ in range(3):
        x = torch.randn(4)
        torch.testing.assert_close(jf(x), f(x))
    assert len(regions(jf, ex)) == 2
    breaks = [b for _, bs, _ in graphs(jf, ex).traces for b in bs]
    assert any(b.reason == "excluded by NoSin.can_fuse" for b in breaks)


def test_static_inputs_are_decided_by_identity():
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    jm = jit(model, emulated)
    x = torch.randn(3, 4, requires_grad=True)
    jm(x).sum().backward()
    (fw,) = regions(jm, emulated, "forward")
    (bw,) = regions(jm, emulated, "backward")
    fw_kinds = dict(zip(fw.info.input_names, fw.kinds, strict=True))
    assert fw_kinds["input"] is InputKind.CALLER
    assert [k for n, k in fw_kinds.items() if n != "input"] == [InputKind.PARAMETER] * 4
    bw_kinds = dict(zip(bw.info.input_names, bw.kinds, strict=True))
    assert bw_kinds["input"] is InputKind.CALLER  # the caller's input, saved for backward
    for name, kind in bw_kinds.items():
        if "weight" in name:
            assert kind is InputKind.PARAMETER
        elif name in fw.info.output_names:
            assert kind is InputKind.GRAPH_OUTPUT
    cotangents = [n for n in bw.info.input_names if n not in fw.info.output_names and "weight" not in n]
    assert cotangents and all(bw_kinds[n] is InputKind.CALLER for n in cotangents)  # "input" among them
    assert InputKind.GRAPH_OUTPUT in bw_kinds.values()


@pytest.mark.parametrize("recomputation_fused", [False, True])
def test_rematerialization_between_graphs(monkeypatch, recomputation_fused):
    # torchcompile_xentropy's fusion pass runs after cudagraphex's and rematerializes between its forward and backward
    # graphs. Recomputation that no executor fuses would add a kernel per op to every backward: it is refused. Fused
    # recomputation is kept, and the forward outputs the backward then reads stay static.
    if recomputation_fused:
        monkeypatch.setattr(executor_module, "_fused_by", lambda inner: lambda bsym: True)
    model = small_gpt("cpu")
    reference = twin(model)
    jm = thunder.jit(model, executors=[emulated, *thunder.get_default_executors()])
    # The same batch every call: a caller's tensor that moves is copied from then on, whatever it was planned as.
    idx, targets = torch.randint(0, 64, (2, 16)), torch.randint(0, 64, (2, 16))
    for _ in range(3):
        loss, expected = jm(idx, targets), reference(idx, targets)
        torch.testing.assert_close(loss, expected)
        loss.backward()
        expected.backward()
        assert_grads_close(model, reference)
        model.zero_grad()
        reference.zero_grad()
        del loss  # held across calls, it would make the next forward run eagerly (its graph output is in use)
    specs = {r.info.phase: graphs(jm, emulated).fusions[r.name].spec for r in regions(jm, emulated)}
    recomputed = {id(b) for b in specs["forward"].bound_symbols} & {id(b) for b in specs["backward"].bound_symbols}
    assert bool(recomputed) is recomputation_fused
    (fw,) = regions(jm, emulated, "forward")
    (bw,) = regions(jm, emulated, "backward")
    saved = [n for n in bw.info.input_names if n in fw.info.output_names]
    assert len(saved) > 10
    bw_kinds = dict(zip(bw.info.input_names, bw.kinds, strict=True))
    # The forward graph's own memory stays static; a view of the caller's targets is the caller's tensor.
    of_caller = {n for n, roots in specs["forward"].aliases.items() if roots <= {"idx", "targets"}}
    assert recomputation_fused or of_caller & set(saved)  # recomputed in the backward when fused
    expected = {n: InputKind.CALLER if n in of_caller else InputKind.GRAPH_OUTPUT for n in saved}
    assert {n: bw_kinds[n] for n in saved} == expected
    # A graph output nobody reads would hold its memory as long as the graph lives.
    forward_trace = thunder.last_traces(jm)[-1]
    readers = [b for b in forward_trace.bound_symbols if b.sym.name != fw.name and b.sym.id != prims.PrimIDs.DEL]
    read = {p.name for b in readers for p in b.flat_proxy_args}
    assert [n for n in fw.info.output_names if n not in read] == []
    assert replays(jm, emulated) >= 4


def _chain_regions():
    """A producer region computing b = cos(sin(x)) and a consumer computing exp(b), as planned."""
    trace = thunder.trace()(lambda x: x.sin().cos().exp(), torch.randn(3))
    sin, cos, exp = (b for b in trace.bound_symbols if b.sym.name in ("sin", "cos", "exp"))
    x, a, b = sin.args[0], sin.output, cos.output
    producer = RegionSpec([sin, cos], [x], [b], "cpu", "forward")
    consumer = RegionSpec([exp], [b], [exp.output], "cpu", "backward")
    return producer, consumer, (sin, cos, exp), (x, a, b)


@pytest.mark.parametrize("fused", [False, True])
def test_refused_rematerialization_is_decided_by_the_producer(fused):
    # Rematerialization hands back a producer that returns a (the cut) instead of b, and a consumer that recomputes b.
    producer, consumer, (sin, cos, exp), (x, a, b) = _chain_regions()
    members, inputs, outputs = refused_rematerialization(producer, [sin, cos], [x], [a], [], lambda bsym: fused)
    assert (members, inputs) == ([sin, cos], [x])
    assert [p.name for p in outputs] == [a.name if fused else b.name]  # no output nobody reads
    rebuilt = dataclasses.replace(producer, outputs=outputs)
    members, inputs, outputs = refused_rematerialization(
        consumer, [cos, exp], [a], [exp.output], [rebuilt], lambda bsym: fused
    )
    assert members == ([cos, exp] if fused else [exp])
    assert [p.name for p in inputs] == [a.name if fused else b.name]


def test_refused_rematerialization_keeps_what_a_recomputation_would_get_wrong_though_it_is_fused():
    producer, _, (sin, cos, _), (x, a, b) = _chain_regions()
    producer = dataclasses.replace(producer, not_recomputable=frozenset({b.name}))
    _, _, outputs = refused_rematerialization(producer, [sin, cos], [x], [a], [], lambda bsym: True)
    assert [p.name for p in outputs] == [b.name]


def test_what_is_computed_from_memory_written_later_is_not_recomputable():
    # Recomputed after the write, `before` would read s as the write left it; `after` already does.
    def f(x, s):
        before = s * 2
        s.add_(1)
        after = s * 3
        return before * x, after * x

    trace = thunder.trace()(f, torch.randn(3), torch.randn(3))
    (write,) = [b for b in trace.bound_symbols if b.sym.name == "add_"]
    before, after = [b for b in trace.bound_symbols if b.sym.name == "mul"][:2]
    s = before.args[0]
    first = RegionSpec([before], [s], [before.output], "cpu", "forward")
    second = RegionSpec([after], [s], [after.output], "cpu", "forward")
    assert not_recomputable([first, write, second]) == {0: frozenset({before.output.name})}
    # The write in the region itself: what it returns is not recomputable either (a recomputation would write again).
    whole = RegionSpec([before, write, after], [s], [before.output, write.output, after.output], "cpu", "forward")
    assert not_recomputable([whole]) == {0: frozenset({before.output.name, write.output.name})}


def _mul_of_itself(x):  # eager refuses its backward: mul_ saved its other argument, which it wrote
    s = x * 2
    s.mul_(s)
    return s


def _saved_then_written(x):  # eager refuses its backward: the product saved s, which mul_ then wrote
    s = x * 2
    t = s * x
    s.mul_(x)
    return s, t


def _written_where_nothing_saved_it(x):
    h = x * 2
    h.add_(0.25)
    return h.sin()


def _no_write(x):
    return (x.square() * x).sin()


@pytest.mark.parametrize(
    ("f", "snapshots"),
    [
        (square_written_by_its_own_mul, 1),
        (_mul_of_itself, 0),
        (_saved_then_written, 0),
        (_written_where_nothing_saved_it, 0),
        (_no_write, 0),
    ],
    ids=lambda v: getattr(v, "__name__", str(v)),
)
def test_a_region_copies_only_what_an_in_place_op_reads_as_itself_for_the_backward(monkeypatch, f, snapshots):
    # Where eager refuses the backward, and where no write follows what the backward reads, the regions are planned
    # as without copies.
    def planned() -> list[tuple[list[str], list[str], list[str]]]:
        jf = thunder.jit(f, executors=[emulated, *thunder.get_default_executors()])
        out = jf(torch.randn(2, 6, requires_grad=True))
        sum(o.sum() for o in (out if isinstance(out, tuple) else (out,))).backward()
        specs = [graphs(jf, emulated).fusions[r.name].spec for r in regions(jf, emulated)]
        return [
            ([b.sym.name for b in s.bound_symbols], [p.name for p in s.inputs], [p.name for p in s.outputs])
            for s in specs
        ]

    with_copies = planned()
    assert sum(members.count("clone") for members, _, _ in with_copies) == snapshots
    monkeypatch.setattr(regions_module, "with_snapshots", lambda sequence, trace: sequence, raising=False)
    assert (with_copies == planned()) is (snapshots == 0)


def test_a_copy_before_a_write_is_taken_though_can_fuse_keeps_clone_out():
    # The copy is cudagraphex's, not the program's: without it the gradient would be plain Thunder's (read after the
    # write), so an override that keeps the program's clones out of graphs does not change what is computed.
    class NoClone(CUDAGraphExecutor):
        def can_fuse(self, bsym):
            return bsym.sym.name != "clone" and super().can_fuse(bsym)

    ex = NoClone("cudagraphex_noclone", backend="emulate", min_region_size=1)
    jf = jit(square_written_by_its_own_mul, ex)
    for _ in range(3):
        x = torch.randn(2, 6, requires_grad=True)
        x_eager = x.detach().clone().requires_grad_()
        for fn, arg in ((jf, x), (square_written_by_its_own_mul, x_eager)):
            cube, total = fn(arg)
            (cube.sum() + total).backward()
        torch.testing.assert_close(x.grad, x_eager.grad)
    specs = [graphs(jf, ex).fusions[r.name].spec for r in regions(jf, ex)]
    assert sum(b.sym.name == "clone" for s in specs for b in s.bound_symbols) == 1


def test_refused_rematerialization_reads_what_an_earlier_graph_returns_though_no_plan_read_it():
    # The consumer planned to read c = exp(b), computed outside graphs; rematerialization hands it back computing c
    # from b, and b from the cut a. Refused, it drops cos (the producer returns b again) and keeps exp, which reads b.
    trace = thunder.trace()(lambda x: x.sin().cos().exp().tan(), torch.randn(3))
    sin, cos, exp, tan = (b for b in trace.bound_symbols if b.sym.name in ("sin", "cos", "exp", "tan"))
    x, a, b, c = sin.args[0], sin.output, cos.output, exp.output
    producer = RegionSpec([sin, cos], [x], [b], "cpu", "forward")
    consumer = RegionSpec([tan], [c], [tan.output], "cpu", "backward")
    members, inputs, _ = refused_rematerialization(
        consumer, [cos, exp, tan], [a], [tan.output], [producer], lambda bsym: False
    )
    assert members == [exp, tan]
    assert [p.name for p in inputs] == [b.name]


def test_a_backward_graph_reads_the_dropout_mask_its_forward_graph_returns():
    # Rematerialization would save the mask's comparison and recompute the float mask in the backward; refused, the
    # forward graph returns the mask and the backward graph reads it, though neither planned region listed it.
    def f(x):
        v = torch.tanh(x)
        scaled = v * x.mean().item()
        return torch.nn.functional.dropout(v, p=0.25, training=True), scaled

    ex = CUDAGraphExecutor("cudagraphex_mask", backend="emulate", min_region_size=1)
    jf = thunder.jit(f, executors=[ex, *thunder.get_default_executors()])
    for _ in range(3):
        x = torch.randn(3, 6, requires_grad=True)
        dropped, scaled = jf(x)
        torch.autograd.backward([dropped, scaled], [torch.ones_like(dropped), torch.ones_like(scaled)])
        v = torch.tanh(x.detach())
        kept = (dropped.detach() != 0).float()
        torch.testing.assert_close(x.grad, (kept / 0.75 + x.detach().mean()) * (1 - v * v))
    assert replays(jf, ex) >= 2


def test_refused_rematerialization_never_reads_what_no_graph_returns():
    producer, consumer, (_, cos, exp), (_, a, _) = _chain_regions()
    gone = dataclasses.replace(producer, outputs=[])  # returns neither the cut nor what the consumer planned to read
    with pytest.raises(RuntimeError, match=a.name):
        refused_rematerialization(consumer, [cos, exp], [a], [exp.output], [gone], lambda bsym: False)


def test_rematerialization_never_loses_a_member_without_inputs():
    # Thunder's dead-code elimination drops a fusion's members that are not prims and have no subsymbols (zeros); the
    # region would read an unbound name. The planned member is put back where it was planned.
    trace = thunder.trace()(lambda x: ltorch.zeros(3, device=x.device, dtype=x.dtype) + x.exp(), torch.randn(3))
    zeros, exp, add = (b for b in trace.bound_symbols if b.sym.name in ("zeros", "exp", "add"))
    x = exp.args[0]
    planned = RegionSpec([zeros, exp, add], [x], [add.output], "cpu", "backward")
    members, inputs, outputs = refused_rematerialization(planned, [exp, add], [x], [add.output], [], lambda b: False)
    assert (members, inputs, outputs) == ([zeros, exp, add], [x], [add.output])


def test_rematerialization_restores_what_a_consumer_recomputes_from_a_producer_thunder_removed():
    # The consumer planned to read z = zeros from a producer graph; rematerialization makes it recompute z, and Thunder
    # removes the producer, whose outputs nobody reads any more, and drops zeros from the consumer: it comes back from
    # the removed producer's members.
    trace = thunder.trace()(lambda x: ltorch.zeros(3, device=x.device, dtype=x.dtype) + x.exp(), torch.randn(3))
    zeros, exp, add = (b for b in trace.bound_symbols if b.sym.name in ("zeros", "exp", "add"))
    x, z = exp.args[0], zeros.output
    producer = RegionSpec([zeros], [], [z], "cpu", "backward")
    consumer = RegionSpec([exp, add], [z, x], [add.output], "cpu", "backward")
    members, inputs, outputs = refused_rematerialization(
        consumer, [exp, add], [x], [add.output], [], lambda b: False, removed=[producer]
    )
    assert (members, inputs, outputs) == ([exp, zeros, add], [x], [add.output])


def test_refused_rematerialization_puts_back_the_members_of_the_outputs_it_keeps():
    # Rematerialization hands back the producer without cos, whose output b it no longer returns; refused, the region
    # returns b again and needs cos back.
    producer, _, (sin, cos, _), (x, a, b) = _chain_regions()
    members, inputs, outputs = refused_rematerialization(producer, [sin], [x], [a], [], lambda bsym: False)
    assert (members, inputs, [p.name for p in outputs]) == ([sin, cos], [x], [b.name])


def test_a_region_handed_back_resorted_runs_in_its_planned_order():
    # Thunder's rematerialization hands a consumer back with its symbols sorted anew; the region runs its planned
    # members in their planned order, and the one it recomputes (tanh, from the producer) right before its first reader.
    def f(x, y):
        a = y.tanh()
        return x.exp() * 2 + a.sin()

    trace = thunder.trace()(f, torch.randn(3), torch.randn(3))
    tanh, exp, mul, sin, add = (
        next(b for b in trace.bound_symbols if b.sym.name == name) for name in ("tanh", "exp", "mul", "sin", "add")
    )
    x, y = exp.args[0], tanh.args[0]
    planned = RegionSpec([exp, mul, sin, add], [x, tanh.output], [add.output], "cpu", "backward")
    members, inputs, _ = refused_rematerialization(
        planned, [tanh, sin, exp, mul, add], [x, y], [add.output], [], lambda bsym: True
    )
    assert (members, inputs) == ([exp, mul, tanh, sin, add], [x, y])


def _peak_intermediate_bytes(bsyms, outputs) -> int:
    """The most bytes the tensors ``bsyms`` compute hold at once when each is freed after its last reader and
    ``outputs`` live to the end (a view counts as a tensor of its own)."""
    last_read = {p.name: i for i, b in enumerate(bsyms) for p in b.flat_proxy_args}
    last_read.update({p.name: len(bsyms) for p in outputs})
    live: dict[str, int] = {}
    peak = 0
    for i, bsym in enumerate(bsyms):
        for p in bsym.flat_proxy_outs:
            if isinstance(p, TensorProxy):
                live[p.name] = p.numel * p.dtype.bytes
        peak = max(peak, sum(live.values()))
        for name in [n for n in live if last_read.get(n, -1) <= i]:
            del live[name]
    return peak


def test_a_gpt_backward_region_holds_no_more_at_once_than_thunders_backward():
    # Rematerialization between the forward and backward graphs hands the backward region back sorted anew, which
    # moved every weight gradient to its end: each layer's activation gradients stayed alive until then (3.2x here).
    def backward_trace(executors):
        torch.manual_seed(0)
        model = GPT(GPTConfig(n_layer=4, n_head=4, n_embd=64, block_size=64, vocab_size=128))
        jm = thunder.jit(model, executors=executors)
        idx = torch.randint(0, 128, (2, 64))
        jm(idx, idx).backward()
        return thunder.last_backward_traces(jm)[-1]

    plain = backward_trace(thunder.get_default_executors())
    # Unpacking the saved tensors computes nothing; the region receives them as inputs.
    body = [b for b in plain.bound_symbols if b.sym.id not in (prims.PrimIDs.DEL, prims.PrimIDs.RETURN)]
    body = [b for b in body if not b.sym.name.startswith("unpack")]
    (ret,) = [b for b in plain.bound_symbols if b.sym.id == prims.PrimIDs.RETURN]
    expected = _peak_intermediate_bytes(body, [p for p in ret.flat_proxy_args if isinstance(p, TensorProxy)])
    graphed = backward_trace([emulated, *thunder.get_default_executors()])
    (region,) = [b for b in graphed.bound_symbols if b.sym.name.startswith("CUDAGraph")]
    got = _peak_intermediate_bytes(region.subsymbols, region.flat_proxy_outs)
    assert got <= 1.1 * expected, (got / 2**20, expected / 2**20)
