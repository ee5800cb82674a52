"""The benchmarks' workloads and variants run on the CPU with the emulated replay backend: train_step with AdamW,
the whole-step variants, the GPT and Llama workloads, generate and the bucketed serving loop."""

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
    report = cudagraphex.explain(compiled.step)
    assert report.captures == 1 and report.replays >= 1, str(report)
    case.close()
    assert compiled.step is None


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


def test_every_variant_and_workload_has_a_place_and_a_cost():
    from benchmarks.schedule import TASK_ORDER, VARIANT_COST, WORKLOAD_COST_S

    ordered = [variant for tier in TASK_ORDER for variant in tier]
    assert sorted(ordered) == sorted(VARIANTS)
    assert set(VARIANT_COST) == set(VARIANTS) and set(WORKLOAD_COST_S) == set(WORKLOADS)


def test_generate_gives_eagers_tokens_through_thunder_and_cudagraphex():
    transformers = pytest.importorskip("transformers")
    if not transformers.__version__.startswith("4."):
        pytest.skip("Thunder traces LlamaForCausalLM.forward under transformers 4.46-4.55 (setup.cfg's bench pin)")
    from benchmarks.generate import run, table

    variants = ["eager", "thunder", "thunder+cudagraphex", "thunder+cudagraphex-step"]
    rows = run(variants, new_tokens=6, rounds=1, log=lambda _: None)
    assert [r.variant for r in rows] == variants, table(rows)
    for r in rows:
        assert r.error is None, table(rows)
        assert r.equal_tokens == 6, table(rows)
        assert r.ms_per_generate > 0
    assert [r.equal_without_graphs for r in rows] == [None, None, 6, 6], table(rows)
    # 3 generates, each a prefill and 5 decode steps: each of the two is captured after 2 warm-up calls
    assert "2 capture(s)" in rows[-1].note and "not captured" not in rows[-1].note, table(rows)


def test_generate_appends_each_run_with_its_code_and_command(tmp_path, monkeypatch):
    from benchmarks.generate import Row, write_run

    monkeypatch.setenv("CUDAGRAPHEX_COMMIT", "0123abc")
    rows = [Row("eager", 20.0, 5.0, 6, 6, 1.0), Row("thunder", None, None, 0, 6, 2.0, error="RuntimeError: boom")]
    first = write_run(rows, ["--layers", "4"], tmp_path)
    second = write_run(rows[:1], ["--variants", "eager"], tmp_path)
    assert first == second and first.name.endswith("-cpu-generate.md")
    text = first.read_text()
    assert text.count("# cudagraphex: Hugging Face `generate`") == 1 and text.count("## Run of") == 2
    assert text.count("code 0123abc") == 2 and "torch " in text
    assert (
        "`python -m benchmarks.generate --layers 4`" in text
        and "`python -m benchmarks.generate --variants eager`" in text
    )
    assert "| eager | 20.0 | 5.0 | 1.00 | 6/6 | – | 1.0 |  |" in text and "RuntimeError: boom" in text


def test_the_llama_training_workload_agrees_with_eager_through_thunder_and_cudagraphex(monkeypatch):
    """llama1b-4l-train, reduced: Hugging Face's model and loss traced by Thunder for training, its regions and its
    whole step captured with the emulated backends; the backward and an AdamW step agree with eager's."""
    transformers = pytest.importorskip("transformers")
    if not transformers.__version__.startswith("4."):
        pytest.skip("Thunder traces LlamaForCausalLM.forward under transformers 4.46-4.55 (setup.cfg's bench pin)")
    _reduced(monkeypatch, "llama1b-4l-train")
    variants = ["eager", "thunder", "thunder+cudagraphex", "thunder+cudagraphex-step"]
    records, _ = _cpu_suite(["llama1b-4l-train"], ["train_bwd", "train_step"], variants)
    for mode, variant in [(m, v) for m in ("train_bwd", "train_step") for v in variants]:
        if (mode, variant) != ("train_bwd", "thunder+cudagraphex-step"):  # step variants run no train_bwd
            r = records[("llama1b-4l-train", mode, variant)]
            assert r.error is None and r.correct is True, (mode, variant, r.error, r.rel_err)
    assert "0 graph(s)" not in records[("llama1b-4l-train", "train_step", "thunder+cudagraphex")].note
    assert "1 capture(s)" in records[("llama1b-4l-train", "train_step", "thunder+cudagraphex-step")].note


def test_the_bucketed_serving_loop_keeps_one_graph_per_size_and_eagers_results(tmp_path, capsys):
    from benchmarks.buckets import SIZES, main

    assert main(["--steps", "6", "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    steps = 6 + 3 * len(SIZES)  # and 3 of each capture size, for the timing ratio
    assert f"{steps} steps, {len(SIZES)} graph(s) for {len(SIZES)} capture sizes" in printed, printed
    assert f"greedy tokens equal to eager's in {steps}/{steps} steps" in printed, printed
    largest_error = float(printed.split("largest |logit - eager logit| ")[1].split()[0])
    assert largest_error < 1e-5, printed
    assert "| 8 |" in printed or "| 4 |" in printed, printed  # a padded size's timing row
    (written,) = tmp_path.glob("*-buckets.md")
    assert "`python -m benchmarks.buckets --steps 6 --out" in written.read_text()
    assert printed.split("\n")[0] in written.read_text()
