"""benchmarks/bench_backward.py on the CPU: the whole script on two tiny layers (kernelgen's CPU
kernels beside F.conv2d's autograd), the JSON it writes and reads back, a failing layer recorded as
an error row while the others go on, the time budget; and, without kernels, the float64 reference
on a sample, the accuracy flag, and the meta planning of each gradient's kernels."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from benchmark_modules import load

bench = load("bench_backward")

# Two layers with a bias (so every gradient is there), one of them depthwise; two cells of one
# precision (the CPU kernels take any strides: both formats share kernels), one timed call a round.
FAST = ["--device", "cpu", "--layers", "tiny.3x3,tiny.dw3x3", "--cells", "ieee-nchw,ieee-cl", "--rounds", "1",
        "--reps", "2", "--warmup", "1"]


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    path = tmp_path_factory.mktemp("backward") / "run.json"
    rc = bench.main(FAST + ["--json", str(path)])
    return rc, json.loads(path.read_text()), path


@pytest.mark.compile
def test_every_gradient_is_timed_finite_and_inside_the_rule(smoke):
    rc, result, _ = smoke
    assert rc == 0
    assert result["device_kind"] == "cpu" and result["torch"] == torch.__version__
    assert result["kernelgen_commit"] is None or len(result["kernelgen_commit"].removesuffix("+dirty")) == 40
    assert [(r["layer"], r["cell"]) for r in result["rows"]] == [
        (name, cell) for name in ("tiny.3x3", "tiny.dw3x3") for cell in ("ieee-nchw", "ieee-cl")]
    for r in result["rows"]:
        assert "error" not in r, r
        for key in ("kernelgen_bwd_ms", "torch_bwd_ms", "kernelgen_fwd_ms", "torch_fwd_ms", "speedup"):
            assert r[key] > 0
        assert r["compiled_late"] == 0  # the meta run found every kernel the backward calls
        assert r["kernels"]["forward"] and r["kernels"]["dx"] and r["kernels"]["dw"]
        assert not r["flagged"]
        for g in ("dx", "dw", "db"):
            e = r["grads"][g]
            assert e["finite"] and e["torch_finite"] and not e["flagged"]
            assert math.isfinite(e["ratio"]) and e["rel_err"] < 1e-5 and e["torch_rel_err"] < 1e-5  # float32, exact
        # tiny layers: float64 checks all of each gradient
        assert r["grads"]["sample"] == dict(dx_images=2, dw_channels=r["shape"]["K"], of_images=2,
                                            of_channels=r["shape"]["K"])
    assert {r["layer"]: r["kind"] for r in result["rows"]} == {"tiny.3x3": "kxk", "tiny.dw3x3": "depthwise"}
    assert result["not_run"] == []


@pytest.mark.compile
def test_the_summary_keeps_depthwise_apart(smoke):
    _, result, _ = smoke
    assert [s["cell"] for s in result["summary"]] == ["ieee-nchw", "ieee-cl"]
    for s in result["summary"]:
        assert s["layers"] == 2 and s["errors"] == s["flagged"] == 0 and s["faster"] + s["slower"] == 2
        assert s["depthwise"] == s["others"] == 1
        rows = {r["kind"]: r for r in result["rows"] if r["cell"] == s["cell"]}
        assert s["depthwise_geomean"] == pytest.approx(rows["depthwise"]["speedup"])
        assert s["others_geomean"] == pytest.approx(rows["kxk"]["speedup"])


@pytest.mark.compile
def test_report_reprints_saved_runs_without_a_device(smoke, capsys):
    _, _, path = smoke
    assert bench.main(["--report", str(path), str(path)]) == 0
    out = capsys.readouterr().out
    assert "| tiny.dw3x3 | depthwise | ieee-cl |" in out
    assert out.count("| tiny.3x3 | kxk | ieee-nchw |") == 1  # the second file's rows replace the first's
    assert "depthwise geomean" in out


@pytest.mark.compile
def test_a_failing_layer_is_an_error_row_and_the_others_go_on(tmp_path, monkeypatch, capsys):
    measure = bench.measure

    def broken(layer, cell, device, args):
        if layer.name == "tiny.3x3":
            raise RuntimeError("no kernel for this one")
        return measure(layer, cell, device, args)

    monkeypatch.setattr(bench, "measure", broken)
    path = tmp_path / "run.json"
    rc = bench.main(["--device", "cpu", "--layers", "tiny.3x3,tiny.dw3x3", "--cells", "ieee-nchw", "--rounds", "1",
                     "--reps", "1", "--warmup", "0", "--json", str(path)])
    assert rc == 1  # some work failed
    rows = {r["layer"]: r for r in json.loads(path.read_text())["rows"]}
    assert rows["tiny.3x3"]["error"] == "RuntimeError: no kernel for this one" and "speedup" not in rows["tiny.3x3"]
    assert rows["tiny.dw3x3"]["speedup"] > 0 and not rows["tiny.dw3x3"]["flagged"]
    assert "ERROR RuntimeError: no kernel for this one" in capsys.readouterr().out


def test_a_spent_budget_runs_nothing_and_says_so(tmp_path):
    path = tmp_path / "run.json"
    assert bench.main(FAST + ["--budget-s", "0", "--json", str(path)]) == 0
    result = json.loads(path.read_text())
    assert result["rows"] == [] and result["summary"] == []
    assert result["not_run"] == ["tiny.3x3", "tiny.dw3x3"]


def test_layers_are_chosen_by_group_and_name(capsys):
    names = [layer.name for layer in bench.select("cases,r50.l1.3x3,case.87,tiny")]
    assert names[:6] == ["case.87", "case.56", "case.63", "case.84", "case.83", "case.stem"]
    assert names[6:] == ["r50.l1.3x3", "tiny.3x3", "tiny.3x3.s2", "tiny.dw3x3", "tiny.pw"]  # each once
    drawn = bench.census.layers(0, 320)[5].name
    assert [layer.name for layer in bench.select(drawn)] == [drawn]
    with pytest.raises(KeyError):
        bench.select("no.such.layer")
    # --list needs no device, whatever --device says
    assert bench.main(["--list", "--device", "cuda", "--skip", "30"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("mv2.pw.144-24") and out[-1].startswith("4 layers")  # cases,layers: 34, less 30


def test_the_meta_run_finds_each_gradients_kernels():
    plan = bench.plan(bench.select("tiny.3x3.s2")[0], "ieee-nchw", "cpu")
    assert len(plan["forward"]) == 1 and len(plan["dw"]) == 1
    assert len(plan["dx"]) == 4  # a stride-2 input gradient: one stride-1 convolution per phase
    assert all(s.stride == (1, 1) for s in plan["dx"])


def test_the_float64_reference_on_a_sample_is_the_whole_one_sliced(monkeypatch):
    layer = bench.Layer("g", 5, 8, 12, 7, 6, (3, 3), groups=4, stride=2, padding=1, bias=False)
    x, w, _, gy = bench.tensors(layer, "ieee", "nchw", "cpu")
    full_dx, full_dw = bench.reference(layer, x, w, gy, layer.N, layer.K, lambda t: t.double())
    xd = x.detach().double().requires_grad_()
    wd = w.detach().double().requires_grad_()
    want = torch.autograd.grad(F.conv2d(xd, wd, None, **layer.kwargs()), (xd, wd), gy.double())
    torch.testing.assert_close(full_dx, want[0])
    torch.testing.assert_close(full_dw, want[1])
    # a tenth of the work: the first image, the first groups (3 output channels a group), in chunks
    monkeypatch.setattr(bench, "REF_FLOPS", layer.flops() / 10)
    monkeypatch.setattr(bench, "REF_ELEMENTS", 2 * 8 * 7 * 6)
    n, ko = bench.sample(layer)
    assert n == 1 and ko == 3
    dx, dw = bench.reference(layer, x, w, gy, n, ko, lambda t: t.double())
    torch.testing.assert_close(dx, want[0][:n])
    torch.testing.assert_close(dw, want[1][:ko])


def test_a_gradient_is_flagged_past_one_and_a_half_torch_error_and_the_float32_bar():
    layer = bench.Layer("t", 2, 4, 6, 6, 6, (3, 3), padding=1, bias=True)
    x, w, b, gy = bench.tensors(layer, "bf16", "nchw", "cpu")
    y = F.conv2d(x, w, b, padding=1)

    def grads():
        return torch.autograd.grad(y, (x, w, b), gy, retain_graph=True)

    def scaled(factor, nan=False):
        def run():
            out = [g.float() * factor for g in grads()]
            if nan:
                out[1][0, 0, 0, 0] = math.nan
            return [g.to(torch.bfloat16) for g in out]
        return run

    same = bench.accuracy(layer, "bf16", x, w, b, gy, {"kernelgen": grads, "torch": grads})
    for g in ("dx", "dw", "db"):
        assert same[g]["ratio"] == 1.0 and not same[g]["flagged"] and same[g]["torch_rel_err"] > 1e-5
    off = bench.accuracy(layer, "bf16", x, w, b, gy, {"kernelgen": scaled(1.05), "torch": grads})
    assert all(off[g]["flagged"] and off[g]["ratio"] > 1.5 for g in ("dx", "dw", "db"))
    bad = bench.accuracy(layer, "bf16", x, w, b, gy, {"kernelgen": scaled(1.0, nan=True), "torch": grads})
    assert bad["dw"]["flagged"] and not bad["dw"]["finite"] and not bad["dx"]["flagged"]


def test_profile_backward_imports_and_asks_for_a_gpu(capsys):
    """benchmarks/profile_backward.py (a GPU tool) loads beside bench_backward and says what it needs."""
    import profile_backward

    if torch.cuda.is_available():
        pytest.skip("has a GPU: the tool would run")
    assert profile_backward.main(["r50.l3.3x3"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
