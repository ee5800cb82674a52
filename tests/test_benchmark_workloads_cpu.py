"""The benchmarks' workloads and variants run on the CPU with the emulated replay backend: train_step with AdamW,
the whole-step variants, the GPT and Llama workloads."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from benchmarks.variants import VARIANTS
from benchmarks.workloads import WORKLOADS


def _reduced(monkeypatch, *names: str) -> None:
    """Makes the suite build ``names`` at the reduced sizes of the CPU plan."""
    for name in names:
        workload = WORKLOADS[name]
        monkeypatch.setitem(
            WORKLOADS, name, dataclasses.replace(workload, build=lambda d, _, b=workload.build: b(d, True))
        )


def _cpu_suite(workloads, modes, variants) -> tuple[dict, list[str]]:
    from benchmarks.measure import Options
    from benchmarks.suite import Suite

    progress = []
    suite = Suite(
        workloads,
        modes,
        variants,
        Options(reps=2, quick=True, budget_s=0),
        device=torch.device("cpu"),
        progress=progress.append,
        log=lambda line: None,
    )
    records = {(r.workload, r.mode, r.variant): r for r in suite.run()}
    assert len(progress) == suite.num_measurements() == len(records)
    return records, progress


def test_train_step_is_checked_on_one_step_from_the_start(monkeypatch):
    """collect() starts from the case's parameters and a zero optimizer state, however many calls came before; it
    compares the loss, the first moments and the loss after the step, so a step that changes nothing fails."""
    from benchmarks import cases
    from benchmarks.measure import compare

    setup = WORKLOADS["nanogpt6-d256-t32-b1"].build(torch.device("cpu"), True)
    model = setup.fresh_model()
    reference = cases.module_case(model, model, "train_step", setup.train_args, torch.tensor(1.0)).collect()
    params = [p for p in model.parameters() if p.requires_grad]
    assert len(reference) == len(params) + 2 and reference[-1] < reference[0]  # the step lowered the loss

    stepped = setup.fresh_model()
    case = cases.module_case(stepped, stepped, "train_step", setup.train_args, torch.tensor(1.0))
    for _ in range(3):
        case.call()
    correct, rel_err = compare(case.collect(), reference, torch.float32)
    assert correct and rel_err < 1e-6

    monkeypatch.setattr(cases, "make_optimizer", lambda params: torch.optim.AdamW(params, lr=0.0, fused=True))
    frozen = setup.fresh_model()
    case = cases.module_case(frozen, frozen, "train_step", setup.train_args, torch.tensor(1.0))
    assert not compare(case.collect(), reference, torch.float32)[0]


def test_the_gpt_workloads_run_a_training_step_on_the_cpu(monkeypatch):
    """nanogpt-thunder-tests and gpt2-124m, reduced, through the suite: eager and Thunder agree after an AdamW step;
    the hand-captured whole step needs CUDA and records its error."""
    _reduced(monkeypatch, "nanogpt-thunder-tests", "gpt2-124m")
    records, _ = _cpu_suite(
        ["nanogpt-thunder-tests", "gpt2-124m"], ["train_step"], ["eager", "thunder", "thunder+wholestep(unsafe)"]
    )
    for workload in ("nanogpt-thunder-tests", "gpt2-124m"):
        for variant in ("eager", "thunder"):
            r = records[(workload, "train_step", variant)]
            assert r.error is None and r.correct is True and r.median_us > 0
        if not torch.cuda.is_available():
            assert records[(workload, "train_step", "thunder+wholestep(unsafe)")].error


def test_unsafe_step_variants_run_train_step_only(monkeypatch):
    _reduced(monkeypatch, "mlp16x256-b8")
    records, _ = _cpu_suite(["mlp16x256-b8"], ["inference", "train_step"], ["eager", "thunder+wholestep(unsafe)"])
    assert records[("mlp16x256-b8", "train_step", "eager")].correct is True
    assert ("mlp16x256-b8", "inference", "thunder+wholestep(unsafe)") not in records
    assert ("mlp16x256-b8", "train_step", "thunder+wholestep(unsafe)") in records


def test_a_step_variant_runs_through_graph_step_on_the_cpu(monkeypatch):
    """thunder+cudagraphex-step with cudagraphex's emulating backends: the suite finds it correct in inference (the
    no-grad forward as the step) and train_step, and its step is captured once and then replayed."""
    import cudagraphex
    from benchmarks.variants import graph_executor, make_variant

    _reduced(monkeypatch, "mlp16x256-b8")
    records, _ = _cpu_suite(["mlp16x256-b8"], ["inference", "train_step"], ["eager", "thunder+cudagraphex-step"])
    for mode in ("inference", "train_step"):
        r = records[("mlp16x256-b8", mode, "thunder+cudagraphex-step")]
        assert r.error is None and r.correct is True and r.median_us > 0
        assert "1 capture(s)" in r.note, r.note

    setup = WORKLOADS["mlp16x256-b8"].build(torch.device("cpu"), True)
    compiled = make_variant("thunder+cudagraphex-step", setup.fresh_model, graph_executor(torch.device("cpu")))
    case = compiled.case("train_step", setup.train_args, torch.randn(8, 256))
    for _ in range(5):  # warm-ups (the first call creates the optimizer state), the capture, a replay
        case.call()
    report = cudagraphex.explain(compiled.explained)
    assert report.captures == 1 and report.replays >= 1, str(report)
    case.close()
    assert compiled.explained is None


def test_the_decode_step_replays_through_graph_step_with_its_cache_guarded(monkeypatch):
    """llama-decode, reduced, through thunder+cudagraphex-step: the step's state includes the static cache's tensors,
    the decode step is captured once and agrees with eager."""
    pytest.importorskip("transformers")
    _reduced(monkeypatch, "llama-decode")
    records, _ = _cpu_suite(["llama-decode"], ["inference"], ["eager", "thunder+cudagraphex-step"])
    r = records[("llama-decode", "inference", "thunder+cudagraphex-step")]
    assert r.error is None and r.correct is True and "1 capture(s)" in r.note, (r.error, r.note)
    model = WORKLOADS["llama-decode"].build(torch.device("cpu"), True).model
    buffers = {id(b) for b in model.kv.buffers()}
    assert all(id(layer.keys) in buffers and id(layer.values) in buffers for layer in model.cache.layers)


def test_every_thunder_variant_compiles_with_the_options_its_name_says():
    """Each ``+part`` of a Thunder variant's name is an executor or a transform, in the order of the name; a name with a
    part that is neither is refused."""
    from thunder.executors.torch_compile import torch_compile_ex
    from thunder.transforms.cudagraph import CUDAGraphTransform

    import cudagraphex
    from benchmarks.variants import graph_executor, thunder_options

    executor = graph_executor(torch.device("cpu"))
    options = thunder_options("thunder+torchcompile+cudagraphex-step", executor)
    assert options["executors"][:2] == [executor, torch_compile_ex] and "transforms" not in options
    options = thunder_options("thunder+cudagraphex+PruneParameterChecks", executor)
    assert options["executors"][0] is executor
    assert [type(t) for t in options["transforms"]] == [cudagraphex.PruneParameterChecks]
    assert [type(t) for t in thunder_options("thunder+CUDAGraphTransform", executor)["transforms"]] == [
        CUDAGraphTransform
    ]
    assert thunder_options("thunder+wholestep(unsafe)", executor) == {}
    for name in VARIANTS:
        if name.startswith("thunder"):
            thunder_options(name, executor)
    with pytest.raises(ValueError, match="not a Thunder variant"):
        thunder_options("thunder+warp-drive", executor)


def test_the_llama_training_workload_agrees_with_eager_through_thunder_and_cudagraphex(monkeypatch):
    """llama1b-4l-train, reduced: Hugging Face's model and loss traced by Thunder for training, its regions and its
    whole step captured with the emulated backends; the backward and an AdamW step agree with eager's."""
    transformers = pytest.importorskip("transformers")
    if not transformers.__version__.startswith("4."):
        pytest.skip("Thunder traces LlamaForCausalLM.forward under transformers 4.46-4.55 (setup.cfg's bench pin)")
    _reduced(monkeypatch, "llama1b-4l-train")
    variants = ["eager", "thunder", "thunder+cudagraphex", "thunder+cudagraphex-step"]
    records, _ = _cpu_suite(["llama1b-4l-train"], ["train_step"], variants)
    for variant in variants:
        r = records[("llama1b-4l-train", "train_step", variant)]
        assert r.error is None and r.correct is True, (variant, r.error, r.rel_err)
    assert "0 graph(s)" not in records[("llama1b-4l-train", "train_step", "thunder+cudagraphex")].note
    assert "1 capture(s)" in records[("llama1b-4l-train", "train_step", "thunder+cudagraphex-step")].note
