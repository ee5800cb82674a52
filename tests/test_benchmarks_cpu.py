"""The benchmark suite on the CPU: the main job's fallback, the result writers, option parsing, failures and the exit
status, and the measuring code run with the emulated replay backend (the workloads and variants themselves:
``test_benchmark_workloads_cpu``; the GPU-only pieces run on a GPU in ``pytest benchmarks/``)."""

from __future__ import annotations

import configparser
import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks.__main__ import parse_args
from benchmarks.cases import MODES
from benchmarks.report import markdown_table, merged, write_results
from benchmarks.variants import STEP_VARIANTS, VARIANTS
from benchmarks.workloads import WORKLOADS

REPO = Path(__file__).resolve().parents[1]


def _run_main(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")  # the CPU path even on a machine with a GPU
    return subprocess.run(
        [sys.executable, "-m", "benchmarks", *args],
        check=False,
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_main_without_gpu_prints_the_capture_plan():
    result = _run_main("--workloads", "mlp16x256-b8")
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert "No CUDA GPU" in out
    assert "sizes reduced for the CPU" in out
    assert "cudagraphex report" in out
    # inference and a training step: the computation trace, then the forward and backward regions
    assert "(computation, cudagraphex_bench_cpu)" in out and "(forward+backward, cudagraphex_bench_cpu)" in out
    assert re.search(r"CUDAGraph\d+ \[backward, cpu\]: \d+ ops, 1 graph\(s\)", out)
    assert out.strip().splitlines()[-1] == "No capture plan failed (1 workload(s))."


@pytest.mark.parametrize(
    ("option", "bad"),
    [("--workloads", "mlp16x256-b8,resnet"), ("--modes", "training"), ("--variants", "eager,thunder+magic")],
)
def test_unknown_names_are_rejected(capsys, option, bad):
    with pytest.raises(SystemExit) as exit_info:
        parse_args([option, bad])
    assert exit_info.value.code != 0
    message = capsys.readouterr().err
    wrong = bad.split(",")[-1]
    assert f"'{wrong}'" in message and option in message


def test_unknown_name_exits_nonzero_from_the_command_line():
    result = _run_main("--variants", "thunder+warp-drive", timeout=120)
    assert result.returncode == 2
    assert "thunder+warp-drive" in result.stderr


def test_default_selection_runs_everything_and_the_microbenchmark():
    args = parse_args([])
    assert args.run_micro and args.run_workloads
    assert args.workloads == list(WORKLOADS) and args.modes == list(MODES) and args.variants == list(VARIANTS)
    only_micro = parse_args(["--micro"])
    assert only_micro.run_micro and not only_micro.run_workloads
    selected = parse_args(["--workloads", "llama-decode"])
    assert selected.run_workloads and not selected.run_micro


def _fake_records():
    rows = [
        ("mlp16x256-b8", "inference", "eager", 300.0),
        ("mlp16x256-b8", "inference", "manual-graph", 100.0),
        ("mlp16x256-b8", "inference", "thunder+CUDAGraphTransform", 200.0),
        ("mlp16x256-b8", "inference", "thunder+cudagraphex", 120.0),
        ("mlp16x256-b8", "train_step", "eager", 800.0),
        ("mlp16x256-b8", "train_step", "manual-graph", 400.0),
    ]
    records = [
        {
            "workload": w,
            "mode": m,
            "variant": v,
            "median_us": t,
            "peak_mem_bytes": 3 * 2**20,
            "steady_peak_mem_bytes": 2 * 2**20,
            "setup_s": 0.5,
            "correct": True,
            "error": None,
        }
        for w, m, v, t in rows
    ]
    records.append(
        {
            "workload": "mlp16x256-b8",
            "mode": "train_step",
            "variant": "thunder",
            "median_us": None,
            "peak_mem_bytes": None,
            "setup_s": None,
            "correct": None,
            "error": "RuntimeError: boom | bang",
        }
    )
    return records


def _table_rows(table: str) -> dict[tuple[str, str], dict[str, str]]:
    lines = table.splitlines()
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    rows = {}
    for line in lines[2:]:
        cells = dict(zip(header, (c.strip() for c in line.strip("|").split("|")), strict=True))
        rows[(cells["mode"], cells["variant"])] = cells
    return rows


_META = {"date": "2026-01-02", "gpu": "NVIDIA H200", "host_breakdown": {"per_copied_input_us": 0.5}}


def test_writers_show_ratios_to_both_references(tmp_path):
    records = _fake_records()
    paths = write_results(records, dict(_META, note="merged from two runs"), tmp_path)

    assert paths["json"].name == "2026-01-02-nvidia-h200.json"
    data = json.loads(paths["json"].read_text())
    assert data["meta"]["gpu"] == "NVIDIA H200" and len(data["records"]) == len(records)

    rows = _table_rows(markdown_table(records))
    eager = rows[("inference", "eager")]
    assert eager["x manual-graph"] == "3.00" and eager["x CUDAGraphTransform"] == "1.50"
    assert rows[("inference", "thunder+cudagraphex")]["x manual-graph"] == "1.20"
    assert rows[("inference", "thunder+cudagraphex")]["x CUDAGraphTransform"] == "0.60"
    assert rows[("train_step", "eager")]["x manual-graph"] == "2.00"
    assert rows[("train_step", "eager")]["x CUDAGraphTransform"] == "–"  # no reference in that mode
    failed = rows[("train_step", "thunder")]
    assert failed["median µs"] == "–" and failed["error"] == "RuntimeError: boom / bang"
    assert eager["peak MiB"] == "3" and eager["steady peak MiB"] == "2"

    md = paths["md"].read_text()
    assert "| mlp16x256-b8 | inference | eager | 300.0 | 3.00 | 1.50 |" in md
    assert "per copied input" in md
    assert "Note: merged from two runs" in md


def test_measuring_code_on_the_cpu_with_the_emulated_backend():
    """The GPU run's code path (build, eager reference, compile, check, time), on the CPU: CUDA-only variants record
    their error and the run goes on."""
    from benchmarks.measure import Options
    from benchmarks.suite import Suite

    progress, log = [], []
    suite = Suite(
        ["mlp16x256-b8"],
        ["inference", "train_step"],
        ["eager", "thunder+cudagraphex", "manual-graph"],
        Options(reps=2, quick=True, budget_s=0),
        micro=True,
        device=torch.device("cpu"),
        progress=progress.append,
        log=log.append,
    )
    assert suite.num_measurements() == 2 * 3 + 15
    records = {(r.workload, r.mode, r.variant): r for r in suite.run()}
    assert len(progress) == suite.num_measurements() == len(records)
    assert any("interleaved" in line for line in log)

    for mode in ("inference", "train_step"):
        for variant in ("eager", "thunder+cudagraphex"):
            r = records[("mlp16x256-b8", mode, variant)]
            assert r.error is None and r.correct is True and r.median_us > 0 and r.setup_s is not None
        graphed = records[("mlp16x256-b8", mode, "thunder+cudagraphex")]
        assert "cudagraphex:" in graphed.note and "0 graph(s)" not in graphed.note
        if not torch.cuda.is_available():  # with CUDA present, capturing CPU work "succeeds" (with a warning)
            assert records[("mlp16x256-b8", mode, "manual-graph")].error  # needs CUDA: recorded, not raised
    assert suite.failures() == [r for r in records.values() if r.variant == "manual-graph"]

    micro = [r for r in records.values() if r.workload == "micro-100ops"]
    assert len(micro) == 15 and all(r.error is None and r.correct is not False and r.median_us > 0 for r in micro)
    assert any("100 output(s)" in (r.note or "") for r in micro)
    breakdown = suite.host_breakdown
    for key in (
        "cudagraphex_overhead_per_region_us",
        "per_region_read_in_place_us",
        "per_copied_input_us",
        "per_returned_output_us",
        "thunder_glue_us",
    ):
        assert isinstance(breakdown[key], float)


def test_a_variant_that_would_not_fit_in_the_budget_is_recorded_as_skipped(monkeypatch):
    """A variant starts only while the time spent plus the longest variant so far fits in the budget."""
    import time

    from benchmarks import suite as suite_module
    from benchmarks.measure import Options
    from benchmarks.report import SKIPPED_FOR_TIME

    original = suite_module.make_variant

    def slow_eager(name, fresh_model, executor):
        time.sleep(1.0)  # the first variant takes a second: a second one would not fit in 1.5 s
        return original(name, fresh_model, executor)

    monkeypatch.setattr(suite_module, "make_variant", slow_eager)
    suite = suite_module.Suite(
        ["mlp16x256-b8"],
        ["inference"],
        ["eager", "thunder"],
        Options(reps=1, quick=True, budget_s=1.5),
        device=torch.device("cpu"),
        log=lambda line: None,
    )
    records = {r.variant: r for r in suite.run()}
    assert records["eager"].error is None and records["eager"].median_us > 0
    assert records["thunder"].error == f"{SKIPPED_FOR_TIME} (--budget-s 1.5)"
    assert suite.failures() == []


def test_merge_keeps_older_records_that_a_run_does_not_redo(tmp_path):
    older = _fake_records()
    write_results(older, dict(_META, runs=[{"started": "earlier"}]), tmp_path)
    redo = dict(older[0], median_us=999.0)  # eager inference, measured again
    skipped = dict(older[1], median_us=None, error="skipped: over the time budget")  # manual-graph, not redone
    new = dict(older[0], variant="thunder", median_us=250.0)
    rows, meta = merged([redo, skipped, new], dict(_META, runs=[{"started": "now"}]), tmp_path)
    by_key = {(r["mode"], r["variant"]): r for r in rows}
    assert len(rows) == len(older) + 1
    assert by_key[("inference", "eager")]["median_us"] == 999.0
    assert by_key[("inference", "manual-graph")]["median_us"] == 100.0
    assert by_key[("inference", "thunder")]["median_us"] == 250.0
    assert [run["started"] for run in meta["runs"]] == ["earlier", "now"]
    write_results(rows, meta, tmp_path)  # a checkpoint of the run started "now", written again later
    _, meta = merged(rows, dict(_META, runs=[{"started": "now"}]), tmp_path)
    assert [run["started"] for run in meta["runs"]] == ["earlier", "now"]


def test_merge_drops_the_runs_whose_records_were_all_redone(tmp_path):
    older = [dict(r, run="earlier") for r in _fake_records()]
    write_results(older, dict(_META, runs=[{"started": "earlier"}]), tmp_path)
    half = [dict(r, median_us=1.0, run="now") for r in older[: len(older) // 2]]
    rows, meta = merged(half, dict(_META, runs=[{"started": "now"}]), tmp_path)
    assert len(rows) == len(older)
    assert [run["started"] for run in meta["runs"]] == ["earlier", "now"]

    write_results(rows, meta, tmp_path)
    rest = [dict(r, median_us=2.0, run="later") for r in older[len(older) // 2 :]]
    rows, meta = merged(rest, dict(_META, runs=[{"started": "later"}]), tmp_path)
    assert {r["run"] for r in rows} == {"now", "later"}
    assert [run["started"] for run in meta["runs"]] == ["now", "later"]


def test_merge_keeps_the_versions_a_file_names_once(tmp_path):
    versions = {"torch": "2.11.0", "transformers": "4.55.4"}
    older = [dict(r, run="earlier") for r in _fake_records()]
    write_results(older, dict(_META, versions=versions, runs=[{"started": "earlier"}]), tmp_path)
    fresh = [dict(older[0], variant="thunder", run="now")]
    now = {"started": "now", "versions": dict(versions, transformers="5.24.0")}
    _, meta = merged(fresh, dict(_META, runs=[now]), tmp_path)
    assert [run["versions"] for run in meta["runs"]] == [versions, now["versions"]]


def test_the_header_names_the_versions_of_each_run(tmp_path):
    one = {"torch": "2.11.0", "transformers": "4.55.4"}
    other = {"torch": "2.11.0", "transformers": "5.24.0"}
    runs = [{"started": "a", "versions": one}, {"started": "b", "versions": one}]
    md = write_results(_fake_records(), dict(_META, runs=runs), tmp_path)["md"].read_text()
    assert md.count("transformers 4.55.4") == 1  # one setup: named once, above the runs

    runs = [{"started": "a", "versions": one}, {"started": "b", "versions": other}]
    md = write_results(_fake_records(), dict(_META, runs=runs), tmp_path)["md"].read_text()
    (line_a,) = [line for line in md.splitlines() if line.startswith("- a,")]
    (line_b,) = [line for line in md.splitlines() if line.startswith("- b,")]
    assert "transformers 4.55.4" in line_a and "transformers 5.24.0" in line_b

    runs = [{"started": "a"}, {"started": "b", "versions": other}]  # a run entry without versions
    md = write_results(_fake_records(), dict(_META, runs=runs), tmp_path)["md"].read_text()
    assert "- a," in md and "versions not recorded" in md and md.count("transformers 5.24.0") == 1


def test_main_job_writes_results_after_each_workload(tmp_path, capsys, monkeypatch):
    """The GPU path of the main job, run on the CPU: partial results are on disk before the run ends."""
    from benchmarks.__main__ import _run_gpu
    from benchmarks.suite import Suite

    written_before_the_end = []
    original = Suite.run

    def run_and_look(suite):
        records = original(suite)
        written_before_the_end.extend(p.name for p in tmp_path.iterdir())
        return records

    args = parse_args(
        ["--workloads", "mlp16x256-b8", "--modes", "inference", "--variants", "eager,thunder+cudagraphex"]
        + ["--quick", "--reps", "2", "--out", str(tmp_path)]
    )
    monkeypatch.setattr(Suite, "run", run_and_look)
    assert _run_gpu(args, device=torch.device("cpu")) == 0
    assert any(name.endswith(".json") for name in written_before_the_end)
    data = json.loads(next(tmp_path.glob("*.json")).read_text())
    assert {r["variant"] for r in data["records"]} == {"eager", "thunder+cudagraphex"}
    assert data["meta"]["runs"][0]["cudagraphex_commit"]
    assert {r["run"] for r in data["records"]} == {data["meta"]["runs"][0]["started"]}
    assert "| mlp16x256-b8 | inference | thunder+cudagraphex |" in capsys.readouterr().out


def test_the_commit_measured_comes_from_the_environment_first(monkeypatch):
    from benchmarks.report import commit

    monkeypatch.setenv("CUDAGRAPHEX_COMMIT", "0123abc")
    assert commit() == "0123abc"  # a copied tree's .git may be stale
    monkeypatch.delenv("CUDAGRAPHEX_COMMIT")
    assert commit() != "0123abc"


# -- failures: whole tracebacks and the exit status ----------------------------------------------------


def _raise_deep(message: str) -> None:
    raise RuntimeError(message)


def _failing_build(device, plan):
    # One call deeper, so that the whole traceback shows a frame that the recorded first line does not.
    _raise_deep("the workload cannot be built\nsecond line of the message")


def _gpu_args(tmp_path, workload: str, modes: str, variants: str):
    return parse_args(
        ["--workloads", workload, "--modes", modes, "--variants", variants]
        + ["--quick", "--reps", "2", "--out", str(tmp_path)]
    )


@pytest.mark.parametrize("failing", ["workload", "variant"])
def test_a_failure_prints_its_whole_traceback_and_fails_the_job(tmp_path, capsys, monkeypatch, failing):
    """The GPU path on the CPU: a workload whose build raises, or a variant whose factory raises."""
    from benchmarks import suite
    from benchmarks.__main__ import _run_gpu

    if failing == "workload":
        monkeypatch.setitem(
            WORKLOADS, "mlp16x256-b8", dataclasses.replace(WORKLOADS["mlp16x256-b8"], build=_failing_build)
        )
        failed_variants = {"eager", "thunder"}
    else:
        original = suite.make_variant

        def make_variant(name, fresh_model, graph_executor):
            if name == "thunder":
                _raise_deep("the variant cannot be made\nsecond line of the message")
            return original(name, fresh_model, graph_executor)

        monkeypatch.setattr(suite, "make_variant", make_variant)
        failed_variants = {"thunder"}

    assert _run_gpu(_gpu_args(tmp_path, "mlp16x256-b8", "inference", "eager,thunder"), device=torch.device("cpu")) == 1
    captured = capsys.readouterr()
    assert "Traceback (most recent call last)" in captured.err
    assert "in _raise_deep" in captured.err and "second line of the message" in captured.err
    last = captured.out.strip().splitlines()[-1]
    assert last.startswith(f"FAILED: {len(failed_variants)} task(s) failed: ")
    for variant in ("eager", "thunder"):
        assert (f"mlp16x256-b8 / {variant} (inference)" in last) == (variant in failed_variants)
    records = {r["variant"]: r for r in json.loads(next(tmp_path.glob("*.json")).read_text())["records"]}
    for variant, record in records.items():
        if variant in failed_variants:
            assert "RuntimeError: the workload cannot be built" in record["error"] or (
                record["error"] == "RuntimeError: the variant cannot be made"
            )
        else:
            assert record["error"] is None and record["median_us"] > 0


def test_a_failing_capture_plan_prints_its_whole_traceback_and_fails_the_job(capsys, monkeypatch):
    from benchmarks.__main__ import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the CPU path even on a machine with a GPU
    monkeypatch.setitem(WORKLOADS, "mlp16x256-b8", dataclasses.replace(WORKLOADS["mlp16x256-b8"], build=_failing_build))
    assert main(["--workloads", "mlp16x256-b8"]) == 1
    out = capsys.readouterr().out
    assert "Traceback (most recent call last)" in out
    assert "in _raise_deep" in out and "second line of the message" in out
    assert out.strip().splitlines()[-1] == "FAILED: the capture plan of 1 workload(s) failed: mlp16x256-b8"


def test_help_lists_the_workloads_modes_and_variants(capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    names = set(re.split(r"[\s,]+", text))
    for name in (*WORKLOADS, *MODES, *VARIANTS, "nanogpt-thunder-tests", "gpt2-124m", *STEP_VARIANTS):
        assert name in names, name
    assert "exit status" in text
    flat = " ".join(text.split())
    assert "(train_step only: thunder+wholestep(unsafe), thunder+torchcompile+wholestep(unsafe))" in flat


def test_the_bench_extra_pins_the_tested_transformers():
    config = configparser.ConfigParser()
    config.read(REPO / "setup.cfg")
    bench = [line.strip() for line in config["options.extras_require"]["bench"].splitlines() if line.strip()]
    assert "transformers==4.55.4" in bench
