"""benchmarks/bench_networks.py on the CPU: the whole script on its tiny network (kernelgen's CPU
kernels beside eager torch), the JSON it writes and reads back, a failing variant recorded as an
error row while the others go on, the time budget, and the accuracy flag."""

from __future__ import annotations

import inspect
import json
import math

import pytest
import torch

import kernelgen

from benchmark_modules import load



bench = load("bench_networks")

# Small and few: one cell, a 16x16 image, one timed forward a round. The CPU's kernels do not
# depend on the batch, so batch 2 compiles nothing more than batch 1.
FAST = ["--device", "cpu", "--networks", "tiny", "--image", "16", "--cells", "fp32-nchw", "--rounds", "1",
        "--reps", "2", "--warmup", "1"]
CONVS = 6  # TinyNet's convolutions: stem, two in the residual body, depthwise, the SE block's two 1x1s
WITH_BN = 4  # ... of which followed by a BatchNorm


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    path = tmp_path_factory.mktemp("networks") / "run.json"
    rc = bench.main(FAST + ["--batches", "1,2", "--no-compile", "--json", str(path)])
    return rc, json.loads(path.read_text()), path


def test_every_variant_runs_on_the_cpu_and_agrees_with_eager(smoke):
    rc, result, _ = smoke
    assert rc == 0
    assert result["device_kind"] == "cpu" and result["torch"] == torch.__version__
    assert result["kernelgen_commit"] is None or len(result["kernelgen_commit"].removesuffix("+dirty")) == 40
    # (frozen weights change only what a CUDA graph replays: no graphs here, no frozen row)
    names = [v.name for v in bench.all_variants(bench.fuse_available()) if not v.compiled and not v.frozen]
    assert [(r["batch"], r["variant"]) for r in result["rows"]] == [(b, v) for b in (1, 2) for v in names]
    for r in result["rows"]:
        assert "error" not in r and "skipped" not in r, r
        assert r["network"] == "tiny" and r["cell"] == "fp32-nchw" and r["graph"] is False  # no graphs on the CPU
        assert r["ms"] > 0 and r["speedup"] > 0
        assert r["finite"] and math.isfinite(r["rel_err"]) and r["rel_err"] < 1e-5  # the CPU's float32 is exact
        assert r["top1_eager"] == 1.0 and r["top1_fp64"] == 1.0 and not r["flagged"]
    assert result["not_run"] == []
    for warm in result["warm"]:  # the meta run found every kernel the conversions call
        assert warm["failed"] == warm["not_found"] == [] and warm["compiled_later"] == 0


def test_the_meta_run_finds_the_folded_16_bit_calls_with_their_scale():
    # bf16 folding keeps the weights and hands conv2d BatchNorm's scale: the warm-up must plan those
    # calls with it, or every one of them compiles on the variant's first call.
    model = kernelgen.convert(bench.in_cell(bench.build(bench.TINY, 0), "bf16-cl", "cpu").to("meta"),
                              fold_bn=True, fuse=bench.fuse_available())
    specs = bench.meta_specs(model, bench.make_input(1, 16, "bf16-cl", "cpu", 0))
    assert len(specs) == CONVS and sum(s.scale for s in specs) == WITH_BN


def test_a_training_step_runs_on_the_cpu_beside_eager(tmp_path):
    path = tmp_path / "train.json"
    rc = bench.main(FAST + ["--train", "--batches", "2", "--no-compile", "--json", str(path)])
    result = json.loads(path.read_text())
    assert rc == 0 and result["train"] and result["batches"] == [2]
    assert [r["variant"] for r in result["rows"]] == ["eager", "kernelgen"]  # (no folding while training)
    for r in result["rows"]:
        assert r["train"] and "error" not in r and r["ms"] > 0 and r["finite"] and not r["flagged"]
        assert r["rel_err"] < 1e-5  # the first step's gradients against float64's
    assert result["rows"][1]["report"]["on_kernelgen"] == CONVS and result["rows"][1]["report"]["fallbacks"] == 0
    # the meta run found the gradients' kernels too: nothing compiled on the first step
    assert [(w["failed"], w["compiled_later"]) for w in result["warm"]] == [([], 0)]
    assert [(g["variant"], g["train"]) for g in result["geomeans"]] == [("kernelgen", True)]


def test_kernelgen_rows_carry_the_report_counts(smoke):
    _, result, _ = smoke
    rows = {(r["batch"], r["variant"]): r for r in result["rows"]}
    assert "report" not in rows[1, "eager"]
    plain, folded = rows[1, "kernelgen"]["report"], rows[1, "kernelgen-bn"]["report"]
    for rep in (plain, folded):
        assert rep["layers"] == rep["on_kernelgen"] == CONVS
        assert rep["fallbacks"] == rep["left_on_torch"] == 0
        assert sum(rep["families"].values()) == CONVS and all(rep["families"])
    assert plain["bn_folded"] == 0 and folded["bn_folded"] == WITH_BN
    assert rows[1, "kernelgen-bn"]["convert"] == {"fold_bn": True}


def test_summary_has_a_geomean_per_cell_batch_and_variant(smoke):
    _, result, _ = smoke
    keys = {(g["cell"], g["batch"], g["variant"]) for g in result["geomeans"]}
    want = {("fp32-nchw", b, r["variant"]) for r in result["rows"] for b in (1, 2) if r["variant"] != "eager"}
    assert keys == want
    assert all(g["networks"] == 1 and g["geomean"] > 0 for g in result["geomeans"])


def test_report_prints_saved_runs_without_a_device(smoke, capsys):
    _, _, path = smoke
    assert bench.main(["--report", str(path), str(path)]) == 0
    out = capsys.readouterr().out
    assert "| tiny | fp32-nchw | 2 | kernelgen-bn |" in out
    assert "geomean speedup" in out


def test_a_failing_variant_is_an_error_row_and_the_others_go_on(tmp_path, monkeypatch, capsys):
    def broken(*args, **kwargs):
        raise RuntimeError("inductor cannot build here")

    monkeypatch.setattr(torch, "compile", broken)
    path = tmp_path / "run.json"
    rc = bench.main(FAST + ["--batches", "1", "--variants", "kernelgen-bn,compile,compile-kernelgen",
                            "--json", str(path)])
    assert rc == 1  # some work failed
    rows = {r["variant"]: r for r in json.loads(path.read_text())["rows"]}
    assert list(rows) == ["eager", "kernelgen-bn", "compile", "compile-kernelgen"]
    for name in ("compile", "compile-kernelgen"):
        assert rows[name]["error"] == "RuntimeError: inductor cannot build here" and "ms" not in rows[name]
    assert rows["kernelgen-bn"]["speedup"] > 0 and rows["kernelgen-bn"]["top1_eager"] == 1.0
    assert "ERROR RuntimeError: inductor cannot build here" in capsys.readouterr().out


def test_a_spent_budget_runs_nothing_and_says_so(tmp_path):
    path = tmp_path / "run.json"
    assert bench.main(FAST + ["--batches", "1,2", "--budget-s", "0", "--json", str(path)]) == 0
    result = json.loads(path.read_text())
    assert result["rows"] == [] and result["geomeans"] == []
    assert result["not_run"] == [dict(network="tiny", cell="fp32-nchw", batch=b) for b in (1, 2)]


def test_fuse_is_a_variant_only_where_convert_takes_it(monkeypatch):
    names = lambda: [v.name for v in bench.all_variants(bench.fuse_available())]  # noqa: E731
    assert ("fuse" in inspect.signature(kernelgen.convert).parameters) == ("kernelgen-bn-fuse" in names())

    def convert(model, example_inputs=None, *, fold_bn=False, tune=False, fallback=None, fuse=False):
        return model

    monkeypatch.setattr(kernelgen, "convert", convert)
    assert "kernelgen-bn-fuse" in names()
    best = dict(bench.all_variants(True)[-1].convert)
    assert best == {"fold_bn": True, "fuse": True}


def test_the_flag_is_past_one_and_a_half_eager_error_and_the_float32_bar():
    def flagged(err, eager_err, finite=True):
        row = dict(variant="kernelgen", rel_err=err, finite=finite)
        bench._flag(row, eager_err)
        return row["flagged"]

    assert flagged(2e-3, 1e-3) and not flagged(1.4e-3, 1e-3)
    assert not flagged(9e-6, 1e-8)  # both float32 rounding: the ratio is noise
    assert flagged(1e-3, 1e-3, finite=False)


def test_plot_writes_svg_or_says_why_not(smoke, tmp_path, capsys):
    _, result, _ = smoke
    path = tmp_path / "speedups.svg"
    if bench.plot(result["rows"], str(path), "test"):
        assert "<svg" in path.read_text()
    else:
        assert not path.exists() and "matplotlib cannot be imported" in capsys.readouterr().out
