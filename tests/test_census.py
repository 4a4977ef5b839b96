"""benchmarks/census.py and networks.py without a GPU: the sample, its validity, the CLI and the
budget and summary logic (with the timing stubbed out)."""

from __future__ import annotations

import json
import sys
from argparse import Namespace

import pytest
import torch
import torch.nn.functional as F

from benchmark_modules import load



census = load("census")
networks = load("networks")
SAMPLE = census.layers()


def test_sample_is_deterministic_per_seed():
    assert census.layers(seed=0) == SAMPLE
    other = census.layers(seed=1)
    assert other != SAMPLE and len(other) == len(SAMPLE) >= 300
    assert len({layer.name for layer in SAMPLE}) == len(SAMPLE)


def test_every_layer_is_valid_and_within_the_caps():
    for layer in SAMPLE:
        x = torch.empty(layer.N, layer.C, layer.H, layer.W, device="meta")
        w = torch.empty(layer.K, layer.C // layer.groups, *layer.kernel, device="meta")
        b = torch.empty(layer.K, device="meta") if layer.bias else None
        y = F.conv2d(x, w, b, **layer.kwargs())  # torch's own shape rules
        assert tuple(y.shape) == (layer.N, layer.K, *layer.out_size()), layer
        assert census.valid(layer) and layer.N * layer.C * layer.H * layer.W * 4 < 400e6, layer
        assert layer.flops() <= census.MAX_FLOPS, layer


def test_output_size_formula_matches_torch_on_real_tensors():
    for layer in SAMPLE[::40]:
        small = census.replace(layer, N=1, C=layer.groups, K=layer.groups * (layer.K // layer.C or 1))
        y = F.conv2d(torch.rand(1, small.C, small.H, small.W), torch.rand(small.K, 1, *small.kernel), **small.kwargs())
        assert tuple(y.shape[2:]) == small.out_size(), layer
    assert census.out_size((5, 5), (3, 3), padding="valid") == (3, 3)
    assert census.out_size((1, 1), (3, 3)) == (-1, -1)  # not valid: drawn again


def test_every_kind_and_variant_occurs():
    kinds = {layer.kind() for layer in SAMPLE}
    assert kinds == {kind for kind, _ in census.KINDS}
    for kind, _ in census.KINDS:  # the name says the kind, and the kind is what was drawn
        assert all(census.draw(census.random.Random(3), kind, 0).kind() == kind for _ in range(20))

    def some(pred):
        return any(pred(layer) for layer in SAMPLE)

    stride, dilation = (lambda l: max(census._pair(l.stride))), (lambda l: max(census._pair(l.dilation)))
    assert some(lambda l: l.kind() == "se" and l.bias and l.K < l.C) and some(lambda l: l.kind() == "se" and l.K > l.C)
    for k in (5, 7):
        assert some(lambda l: l.kind() == "kxk" and l.kernel == (k, k))
        assert some(lambda l: l.kind() == "depthwise" and l.kernel == (k, k))
    for kernel in ((1, 7), (7, 1), (3, 1), (1, 3)):
        assert some(lambda l: l.kernel == kernel)
    for k, s in ((3, 2), (7, 2), (11, 4), (4, 4)):
        assert some(lambda l: l.kind() == "stem" and l.C == 3 and l.kernel == (k, k) and stride(l) == s)
    assert some(lambda l: l.kind() == "strided" and l.kernel == (3, 3) and stride(l) == 2)
    assert some(lambda l: l.kind() == "strided" and l.kernel == (1, 1) and stride(l) == 2)
    assert some(lambda l: stride(l) in (3, 4) and l.C > 3)
    assert {dilation(l) for l in SAMPLE} >= {2, 3, 4}
    grouped = [l for l in SAMPLE if l.kind() == "grouped"]
    assert all(2 <= l.groups <= 64 and 4 <= l.C // l.groups <= 64 for l in grouped)
    assert {32, 64} <= {l.groups for l in grouped} and some(lambda l: l.kind() == "grouped" and l.groups % 2)
    assert some(lambda l: l.kind() == "depthwise" and stride(l) == 2)
    assert some(lambda l: l.kind() == "depthwise" and l.K == 2 * l.C)
    assert some(lambda l: l.bias) and some(lambda l: not l.bias)
    assert some(lambda l: l.H != l.W) and some(lambda l: isinstance(l.padding, tuple))
    assert {1, 8, 16, 32} <= {l.N for l in SAMPLE} and some(lambda l: l.N in (3, 5))


def test_channel_counts_include_ones_that_are_not_multiples_of_8():
    odd = [l for l in SAMPLE if l.kind() != "stem" and (l.C % 8 or l.K % 8)]
    assert len(odd) >= 30
    assert max(l.C for l in SAMPLE) >= 1024 and min(l.C for l in SAMPLE if l.kind() != "stem") <= 16


def test_list_needs_no_gpu(capsys):
    assert census.main(["--list", "--n", "20"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 21 and out[0].startswith("c0000.") and out[-1].startswith("20 layers: 1x1 ")


def test_unknown_cell_is_refused(capsys):
    with pytest.raises(SystemExit):
        census.main(["--list", "--cells", "tf32-nhwc"])
    assert "tf32-nhwc" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without CUDA")
def test_timing_without_cuda_exits_2(capsys):
    assert census.main(["--n", "4"]) == 2
    assert "CUDA" in capsys.readouterr().err


def _fake_row(layer, precision, fmt):
    speedup = 0.5 if layer.kind() == "depthwise" else 1.25
    return dict(family=layer.kind(), spec="s", kernelgen_stream_ms=1.0, torch_stream_ms=speedup, speedup=speedup,
                rel_err=0.0, accurate=True)


def test_budget_stops_new_work_and_still_summarises(monkeypatch, tmp_path, capsys):
    clock = iter(range(10 ** 6))  # every look at the clock is one second later
    monkeypatch.setattr(census.time, "monotonic", lambda: float(next(clock)))
    failing = set()

    def warm(part, precision, fmt, jobs):  # the first compile of each cell fails for one layer
        first = (precision, fmt) not in failing
        failing.add((precision, fmt))
        return {part[0].name: "compile failed: x"} if first else {}

    monkeypatch.setattr(census, "warm", warm)
    monkeypatch.setattr(census, "measure", _fake_row)
    monkeypatch.setattr(census.torch.cuda, "get_device_name", lambda: "fake GPU")
    monkeypatch.setattr(census.torch.cuda, "empty_cache", lambda: None)
    args = Namespace(seed=0, n=40, budget_s=60, tune=False, top=4, networks=False, json=str(tmp_path / "c.json"))
    cells = ["tf32-nchw", "bf16-cl"]
    assert census.run(census.layers(n=40), cells, args) == 1  # the compile failure is a row of its own
    out = capsys.readouterr().out
    assert "covered 40 of 40 layers in cell tf32-nchw" not in out and "in cell bf16-cl" in out
    data = json.loads((tmp_path / "c.json").read_text())
    assert data["device"] == "fake GPU" and data["cells"] == cells
    for cell in cells:
        s = data["summary"][cell]
        assert 0 < s["covered"] < 40 and s["errors"] == 1 and s["untuned"]["measured"] == s["covered"] - 1
    # Each cell takes its layers in its own seeded order.
    names = {cell: [r["name"] for r in data["rows"] if r["cell"] == cell] for cell in cells}
    assert names["tf32-nchw"][:3] != names["bf16-cl"][:3]


def test_summary_figures():
    rows = [dict(name=n, cell="tf32-cl", speedup=s, family=f, accurate=True)
            for n, s, f in (("a", 2.0, "nhwc"), ("b", 0.5, "direct"), ("c", 1.0, "nhwc"), ("d", 0.94, "nhwc"))]
    rows.append(dict(name="e", cell="tf32-cl", error="RuntimeError: x"))
    rows[0].update(tuned_speedup=4.0, tuned_family="nhwc_tma", tuned_accurate=False)
    s = census.summarize(rows, ["tf32-cl", "bf16-cl"], 10)
    untuned = s["tf32-cl"]["untuned"]
    assert (s["tf32-cl"]["covered"], s["tf32-cl"]["errors"], untuned["measured"]) == (5, 1, 4)
    assert untuned["geomean"] == pytest.approx((2.0 * 0.5 * 1.0 * 0.94) ** 0.25)
    assert untuned["at_least_0_95"] == 0.5
    assert [w[0] for w in untuned["worst"]] == ["b", "d", "c"]
    assert untuned["families"]["nhwc"]["count"] == 3
    assert s["tf32-cl"]["tuned"]["inaccurate"] == 1 and s["bf16-cl"]["untuned"] is None
    lines = census.summary_lines(s)
    assert any(line.startswith("| tf32-cl tuned | 5 of 10 |") for line in lines)
    assert "| bf16-cl | 0 of 10 | 0 | 0 | | | | |" in lines


def test_tuning_retimes_with_tune_calls(monkeypatch):
    sample = census.layers(n=6)
    by_name = {layer.name: layer for layer in sample}
    rows = [dict(name=layer.name, cell="bf16-nchw") for layer in sample]
    rows[1]["error"] = "x"
    seen = []

    class Tuned:
        spec = Namespace(family="fam", summary=lambda: "spec")
        timings = [0.1, 0.2]

    def tune_calls(calls, top, jobs):
        seen.extend(calls)
        return [Tuned() for _ in calls]

    monkeypatch.setattr(census.kernelgen, "tune_calls", tune_calls, raising=False)
    monkeypatch.setattr(census, "_tensors", lambda layer, *a: ("x", "w", "b" if layer.bias else None))
    monkeypatch.setattr(census, "_measure", lambda *a: dict(kernelgen_stream_ms=1.0, torch_stream_ms=2.0,
                                                            speedup=2.0, rel_err=0.0, accurate=True))
    monkeypatch.setattr(census.torch.cuda, "empty_cache", lambda: None)
    census.tune_cell(rows, by_name, "bf16-nchw", float("inf"), top=4, jobs=2)
    assert len(seen) == 5 and all(c["precision"] is None and "dilation" in c and "bias" in c for c in seen)
    assert all(r["tuned_speedup"] == 2.0 and r["tuned_family"] == "fam" for r in rows if "error" not in r)


def test_networks_say_what_is_missing(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchvision", None)  # makes `import torchvision` fail
    with pytest.raises(ImportError, match="torchvision"):
        networks.distinct_layers(("resnet50",))


def _has_torchvision() -> bool:
    try:
        networks._torchvision()
    except ImportError:
        return False
    return True


@pytest.mark.skipif(not _has_torchvision(), reason="needs torchvision")
def test_resnet50_distinct_layers():
    found = networks.network_layers("resnet50", batch=1)
    layers = networks.distinct_layers(("resnet50",), batch=1)
    assert layers == [layer for layer, _ in found] and len(layers) == 23
    assert sum(calls for _, calls in found) == 53
    assert layers[0] == census.Layer(name="resnet50.conv1", N=1, C=3, K=64, H=224, W=224, kernel=(7, 7), stride=2,
                                     padding=3)
    by_name = dict((layer.name, (layer, calls)) for layer, calls in found)
    layer, calls = by_name["resnet50.layer3.1.conv2"]
    assert (layer.C, layer.K, layer.H, layer.kernel, layer.padding, calls) == (256, 256, 14, (3, 3), 1, 5)
    layer, _ = by_name["resnet50.layer4.0.downsample.0"]
    assert (layer.C, layer.K, layer.H, layer.stride, layer.out_size()) == (1024, 2048, 14, 2, (7, 7))
