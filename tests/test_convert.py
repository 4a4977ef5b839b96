"""kernelgen.convert / revert / report on small models, on the CPU path (real C++ kernels).

Layers keep 8 channels at 12x12 where they can, so that the few kernels the file needs compile
once (the session cache) and are shared between tests.
"""

from __future__ import annotations

import copy
import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kernelgen
from kernelgen import tuner
from model_state import assert_same_state, randomise_bn, snapshot

pytestmark = pytest.mark.compile

REPO = Path(__file__).resolve().parent.parent


class WSConv2d(nn.Conv2d):
    """Weight standardisation through _conv_forward, as timm-style layers do: converted."""

    def forward(self, x):
        w = self.weight
        w = (w - w.mean(dim=(1, 2, 3), keepdim=True)) / (w.std(dim=(1, 2, 3), keepdim=True) + 1e-5)
        return self._conv_forward(x, w, self.bias)


class OwnConv2d(nn.Conv2d):
    """A subclass that computes its convolution itself: left on torch."""

    def forward(self, x):
        return F.conv2d(x, self.weight, self.bias, self.stride, self.padding, self.dilation, self.groups)


class Net(nn.Module):
    """Convs with BatchNorm and ReLU, a grouped and a depthwise conv, a reflect-padded one, a
    subclass of each kind, and a conv whose output two layers read (its bn is not foldable)."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU())
        self.grouped = nn.Conv2d(8, 8, 3, padding=1, groups=2, bias=False)
        self.bn1 = nn.BatchNorm2d(8)
        self.dw = nn.Conv2d(8, 8, 3, padding=1, groups=8)
        self.bn2 = nn.BatchNorm2d(8)
        self.ws = WSConv2d(8, 8, 3, padding=1)
        self.own = OwnConv2d(8, 8, 1)
        self.reflect = nn.Conv2d(8, 8, 3, padding=1, padding_mode="reflect")
        self.bn3 = nn.BatchNorm2d(8)

    def forward(self, x):
        x = self.stem(x)
        x = F.relu(self.bn1(self.grouped(x)))
        x = F.relu(self.bn2(self.dw(x)))
        x = self.own(self.ws(x))
        y = self.reflect(x)
        return self.bn3(y) + y  # y read twice: bn3 stays


def _net(dtype=torch.float32):
    torch.manual_seed(0)
    return randomise_bn(Net()).to(dtype).eval()


def _x(dtype=torch.float32, n=2):
    return torch.randn(n, 3, 12, 12, generator=torch.Generator().manual_seed(1), dtype=dtype)


def test_convert_swaps_every_conv_keeping_parameters_state_and_hooks():
    model = _net()
    x = _x().contiguous(memory_format=torch.channels_last)
    with torch.no_grad():
        ref = model(x)
    state, params = snapshot(model), {n: p for n, p in model.named_parameters()}
    seen = []
    model.dw.register_forward_hook(lambda m, i, o: seen.append(o.shape))

    assert kernelgen.convert(model) is model
    convs = {n: type(m) for n, m in model.named_modules() if isinstance(m, nn.Conv2d)}
    assert {n for n, t in convs.items() if issubclass(t, kernelgen.Conv2d)} == {
        "stem.0", "grouped", "dw", "ws", "reflect"}
    assert convs["own"] is OwnConv2d  # computes its own convolution: left alone
    assert isinstance(model.ws, WSConv2d) and type(model.ws).forward is WSConv2d.forward
    assert {n: p for n, p in model.named_parameters()} == params  # the same Parameter objects
    assert_same_state(model.state_dict(), state)
    assert not model.training and not model.dw.training
    with torch.no_grad():
        out = model(x)
    assert seen == [torch.Size([2, 8, 12, 12])]
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert kernelgen.convert(model) is model  # converting again changes nothing
    assert type(model.stem[0]) is kernelgen.Conv2d


def test_revert_round_trip_is_bit_identical():
    model = _net().train()
    x = _x()
    with torch.no_grad():
        ref = model.eval()(x)
    model.train()
    state = snapshot(model)
    kernelgen.revert(kernelgen.convert(model))
    assert model.training and model.stem[0].training
    assert type(model.stem[0]) is nn.Conv2d and type(model.ws) is WSConv2d and type(model.own) is OwnConv2d
    assert not any(hasattr(m, "kernelgen_layer") or "precision" in m.__dict__ for m in model.modules())
    assert_same_state(model.state_dict(), state)
    with torch.no_grad():
        assert torch.equal(model.eval()(x), ref)


def test_revert_turns_a_kernelgen_conv2d_into_torchs():
    m = kernelgen.Conv2d(8, 8, 3, padding=1)
    state = snapshot(m)
    assert type(kernelgen.revert(m)) is nn.Conv2d
    assert_same_state(m.state_dict(), state)
    assert "precision" not in m.__dict__


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_fold_bn_keeps_outputs(dtype, tol):
    model, x = _net(dtype), _x(dtype)
    with torch.no_grad():
        ref = model(x)
        exact = _net(torch.float64)(x.double())
    kernelgen.convert(model, fold_bn=True)
    assert isinstance(model.stem[1], nn.Identity) and isinstance(model.bn1, nn.Identity)
    assert isinstance(model.bn2, nn.Identity)
    assert isinstance(model.bn3, nn.BatchNorm2d)  # its conv's output is read twice
    assert model.stem[0].bias is not None and model.stem[0].bias.dtype == dtype
    folded = {n: m.kernelgen_layer.bn for n, m in model.named_modules() if hasattr(m, "kernelgen_layer")}
    assert folded == {"stem.0": "stem.1", "grouped": "bn1", "dw": "bn2", "ws": None, "reflect": None}
    assert not any(k.startswith(("stem.1.", "bn1.", "bn2.")) for k in model.state_dict())
    with torch.no_grad():
        out = model(x)
    assert out.dtype == dtype
    # float32: no further from the float64 answer than float32 rounding puts the unfolded model
    err, own = (out.double() - exact).norm() / exact.norm(), (ref.double() - exact).norm() / exact.norm()
    assert err <= max(tol, 4 * own), (err, own)
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol)


class Untraceable(nn.Module):
    """Control flow on a tensor's value: torch.fx cannot trace it, so pairs come from nn.Sequential."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
                                  nn.Conv2d(8, 8, 3, padding=1, groups=2, bias=False), nn.BatchNorm2d(8))

    def forward(self, x):
        y = self.body(x)
        return y if bool(y.sum() > -1e30) else -y


def test_fold_bn_by_module_patterns_where_fx_cannot_trace():
    torch.manual_seed(0)
    model, x = randomise_bn(Untraceable()).eval(), _x()
    with pytest.raises(Exception):
        torch.fx.symbolic_trace(model)
    with torch.no_grad():
        ref = model(x)
    kernelgen.convert(model, fold_bn=True)
    assert [type(m) for m in model.body] == [kernelgen.Conv2d, nn.Identity, nn.ReLU, kernelgen.Conv2d, nn.Identity]
    with torch.no_grad():
        torch.testing.assert_close(model(x), ref, rtol=1e-5, atol=1e-5)


def test_fold_bn_refuses_training_mode():
    model = _net().train()
    state = snapshot(model)
    with pytest.raises(ValueError, match="eval mode"):
        kernelgen.convert(model, fold_bn=True)
    assert_same_state(model.state_dict(), state)  # nothing folded
    model.eval()
    model.bn1.train()
    with pytest.raises(ValueError, match="bn1 is in training mode"):
        kernelgen.convert(model, fold_bn=True)


class BasicBlock(nn.Module):
    """torchvision's resnet BasicBlock, by hand (torchvision is optional)."""

    def __init__(self, cin, cout, stride=1):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + identity)


class TinyResNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(8)
        self.layer1 = nn.Sequential(BasicBlock(8, 8), BasicBlock(8, 16, stride=2))

    def forward(self, x):
        return self.layer1(torch.relu(self.bn1(self.conv1(x))))


def test_resnet_block_fold_report_and_round_trip():
    torch.manual_seed(0)
    model, x = randomise_bn(TinyResNet()).eval(), _x()
    original = copy.deepcopy(model)
    with torch.no_grad():
        ref = model(x)
    kernelgen.convert(model, (x,), fold_bn=True)
    assert not any(isinstance(m, nn.BatchNorm2d) for m in model.modules())
    with torch.no_grad():
        torch.testing.assert_close(model(x), ref, rtol=1e-5, atol=1e-5)
    rows = {r["name"]: r for r in kernelgen.report(model).rows}
    assert list(rows) == ["conv1", "layer1.0.conv1", "layer1.0.conv2", "layer1.1.conv1", "layer1.1.conv2",
                          "layer1.1.downsample.0"]
    assert rows["layer1.1.downsample.0"]["bn"] == "layer1.1.downsample.1"
    assert rows["layer1.1.conv1"]["input"] == (2, 8, 12, 12) and rows["layer1.1.conv2"]["input"] == (2, 16, 6, 6)
    assert all(r["kernel"].startswith("cpu_direct[") and r["fallback"] is None for r in rows.values())
    assert rows["layer1.1.downsample.0"]["plan"].endswith("k1x1 s2x2 p0,0,0,0 d1x1 +bias")
    kernelgen.revert(model)
    assert sum(type(m) is nn.Conv2d for m in model.modules()) == 6
    with torch.no_grad():  # reverted, the folded model computes with torch again
        torch.testing.assert_close(model(x), original(x), rtol=1e-5, atol=1e-5)


def test_torchvision_resnet18_converts():
    models = pytest.importorskip("torchvision.models")
    model, x = models.resnet18(num_classes=10).eval(), torch.randn(1, 3, 32, 32)
    with torch.no_grad():
        ref = model(x)
        kernelgen.convert(model, fold_bn=True)
        out = model(x)
    assert not any(isinstance(m, nn.BatchNorm2d) for m in model.modules())
    assert all(isinstance(m, kernelgen.Conv2d) for m in model.modules() if isinstance(m, nn.Conv2d))
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


def test_fallback_keeps_torch_for_a_layer_measured_slower(monkeypatch, caplog):
    model, x = _net(), _x()
    with torch.no_grad():
        ref = model(x)
    timed = []

    def fake_stream_us(fns, cuda=True):  # (kernelgen, F.conv2d): the first layer timed is slower
        timed.append(len(fns))
        return [9.0, 3.0] if len(timed) == 1 else [2.0, 3.0]

    monkeypatch.setattr(tuner, "_stream_us", fake_stream_us)
    before = kernelgen.stats().get("convert_fallbacks", 0)
    with caplog.at_level(logging.INFO, logger="kernelgen"):
        kernelgen.convert(model, x, fallback="torch")
    assert timed == [2] * 5  # one timing of each converted layer's call, kernelgen's beside torch's
    assert type(model.stem[0]) is nn.Conv2d and model.stem[0].kernelgen_layer.fallback == "torch"
    assert type(model.grouped) is kernelgen.Conv2d and model.grouped.kernelgen_layer.fallback is None
    assert kernelgen.stats()["convert_fallbacks"] == before + 1
    assert any(r.levelno == logging.INFO and "stem.0 keeps torch's convolution" in r.getMessage()
               for r in caplog.records)
    rows = {r["name"]: r for r in kernelgen.report(model).rows}
    assert rows["stem.0"]["fallback"] == "torch" and rows["stem.0"]["us"] == 9.0
    assert rows["stem.0"]["torch_us"] == 3.0 and rows["dw"]["us"] == 2.0 and rows["dw"]["fallback"] is None
    text = str(kernelgen.report(model))
    assert "torch" in text.splitlines()[2] and "5 layer(s): 4 on kernelgen, 1 on torch (fallback)" in text
    with torch.no_grad():
        torch.testing.assert_close(model(x), ref, rtol=1e-5, atol=1e-5)
    kernelgen.revert(model)
    assert type(model.stem[0]) is nn.Conv2d and not hasattr(model.stem[0], "kernelgen_layer")


def test_fallback_off_by_default(monkeypatch):
    monkeypatch.setattr(tuner, "_stream_us", lambda fns, cuda=True: [9.0, 3.0])
    model, x = _net(), _x()
    kernelgen.convert(model, x, tune=False)  # nothing measured without tune or fallback
    assert all(r["us"] is None and r["fallback"] is None for r in kernelgen.report(model).rows)


def test_tune_measures_each_distinct_call_and_serves_the_choice(fresh_cache, monkeypatch):
    # cpu_direct's two configurations; the second (cout_block 4) made to look faster
    monkeypatch.setattr(tuner, "_stream_us", lambda fns, cuda=True: [2.0, 1.0][:len(fns)])
    tuned = []
    real = tuner.tune_calls
    monkeypatch.setattr(tuner, "tune_calls", lambda calls, **kw: tuned.append(len(calls)) or real(calls, **kw))
    model = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1)).eval()
    x = torch.randn(2, 8, 12, 12)
    with torch.no_grad():
        ref = model(x)
    kernelgen.convert(model, (x,), tune=True)
    assert tuned == [1]  # two layers, one distinct call
    rows = kernelgen.report(model).rows
    assert [r["kernel"] for r in rows] == ["cpu_direct[cout_block=4] (tuned)"] * 2
    assert all(r["tuned"] and r["us"] == 2.0 and r["torch_us"] == 1.0 and r["fallback"] is None for r in rows)
    with torch.no_grad():
        torch.testing.assert_close(model(x), ref, rtol=1e-5, atol=1e-5)


def test_report_records_inputs_when_given_them():
    model = _net()
    kernelgen.convert(model)
    report = kernelgen.report(model)
    assert [r["name"] for r in report.rows] == ["stem.0", "grouped", "dw", "ws", "reflect"]
    assert all(r["input"] is None and r["kernel"] is None for r in report.rows)
    x = _x().contiguous(memory_format=torch.channels_last)
    report = kernelgen.report(model, x)
    rows = {r["name"]: r for r in report.rows}
    assert rows["stem.0"]["input"] == (2, 3, 12, 12)
    assert rows["reflect"]["input"] == (2, 8, 14, 14)  # what the convolution reads: padded by F.pad
    assert " g2 " in rows["grouped"]["plan"] and " g8 " in rows["dw"]["plan"]
    lines = str(report).splitlines()
    assert lines[0].split() == ["layer", "input", "kernel", "bn", "folded", "fused", "fallback", "kernelgen", "µs",
                                "F.conv2d", "µs"]
    assert lines[2].startswith("stem.0") and "2x3x12x12" in lines[2] and "cpu_direct[cout_block=" in lines[2]
    assert lines[-1] == "5 layer(s): 5 on kernelgen, 0 on torch (fallback), 0 with BatchNorm folded, 0 fused"


def test_bad_arguments_say_what_is_wrong():
    with pytest.raises(ValueError, match="fallback='cudnn'"):
        kernelgen.convert(_net(), _x(), fallback="cudnn")
    with pytest.raises(ValueError, match="tune=True needs example_inputs"):
        kernelgen.convert(_net(), tune=True)
    with pytest.raises(ValueError, match="fallback='torch' needs example_inputs"):
        kernelgen.convert(_net(), fallback="torch")


def test_kernelgen_convert_stays_the_function_after_importing_the_module():
    code = "import kernelgen.conversion, kernelgen; assert callable(kernelgen.convert), kernelgen.convert"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


def test_converted_model_pickles_and_deep_copies(tmp_path):
    model, x = _net(), _x()
    kernelgen.convert(model, x)
    torch.save(model, tmp_path / "model.pt")
    loaded = torch.load(tmp_path / "model.pt", weights_only=False)
    for m in (loaded, copy.deepcopy(model)):
        assert type(m.ws) is type(model.ws) and type(m.stem[0]) is kernelgen.Conv2d
        assert m.ws.kernelgen_layer.original is WSConv2d and m.ws.kernelgen_layer.input.shape == (2, 8, 12, 12)
        with torch.no_grad():
            assert torch.equal(m(x), model(x))
        kernelgen.revert(m)
        assert type(m.ws) is WSConv2d


class Shared(nn.Module):
    """One conv called twice, each time before a BatchNorm: neither bn can be folded into it."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(8, 8, 3, padding=1)
        self.a, self.b = nn.BatchNorm2d(8), nn.BatchNorm2d(8)

    def forward(self, x):
        return self.b(self.conv(self.a(self.conv(x))))


def test_a_shared_conv_is_converted_once_and_not_folded():
    torch.manual_seed(0)
    model, x = randomise_bn(Shared()).eval(), torch.randn(2, 8, 12, 12)
    with torch.no_grad():
        ref = model(x)
    kernelgen.convert(model, x, fold_bn=True)
    assert type(model.conv) is kernelgen.Conv2d and isinstance(model.a, nn.BatchNorm2d)
    assert [r["name"] for r in kernelgen.report(model).rows] == ["conv"]
    with torch.no_grad():
        torch.testing.assert_close(model(x), ref, rtol=1e-5, atol=1e-5)


def test_a_lone_conv_converts_as_the_model_itself():
    conv = nn.Conv2d(8, 8, 3, padding=1)
    assert type(kernelgen.convert(conv)) is kernelgen.Conv2d
    assert kernelgen.report(conv).rows[0]["name"] == "Conv2d"
    assert type(kernelgen.revert(conv)) is nn.Conv2d


def test_a_converted_model_is_freed_without_waiting_for_the_garbage_collector():
    import gc
    import weakref

    model = _net()
    kernelgen.convert(model, fold_bn=True)  # traces the model with torch.fx
    gc.disable()
    try:
        alive = weakref.ref(model)
        del model
        assert alive() is None  # no reference cycle (fx's tracer and graph) holds it, or its memory
    finally:
        gc.enable()


def test_fold_bn_keeps_16_bit_weights_and_applies_the_scale_in_float32():
    # bf16: w * scale rounded to bf16 a second time costs ResNet-50 1.66x eager's error; the weights
    # stay as they are and the kernel's epilogue applies the scale to its float32 accumulator.
    torch.manual_seed(0)
    model = randomise_bn(TinyResNet()).eval().to(torch.bfloat16)
    x = _x(torch.bfloat16)
    weights = {n: m.weight.detach().clone() for n, m in model.named_modules() if isinstance(m, nn.Conv2d)}
    with torch.no_grad():
        eager = model(x)
        exact = copy.deepcopy(model).double()(x.double())
    kernelgen.convert(model, fold_bn=True)
    convs = {n: m for n, m in model.named_modules() if isinstance(m, nn.Conv2d)}
    assert not any(isinstance(m, nn.BatchNorm2d) for m in model.modules())
    for n, m in convs.items():
        assert torch.equal(m.weight.view(torch.int16), weights[n].view(torch.int16)), n  # bit-identical
        assert m.bn_scale.dtype == torch.float32 and m.bn_scale.shape == (m.out_channels,), n
        assert m.bias.dtype == torch.bfloat16 and n + ".bn_scale" in model.state_dict()
    with torch.no_grad():
        out = model(x)
    err = (out.double() - exact).norm() / exact.norm()
    own = (eager.double() - exact).norm() / exact.norm()
    assert err <= 1.5 * own, (err, own)
    kernelgen.revert(model)  # a plain torch model again: the scale folded into the weights, rounded
    assert all(type(m) is nn.Conv2d and "bn_scale" not in m._buffers for m in convs.values())
    with torch.no_grad():
        back = model(x)
    assert (back.double() - out.double()).norm() / out.double().norm() <= 2 * own


@pytest.mark.parametrize("groups", [8, 2])
def test_fold_bn_keeps_16_bit_grouped_and_depthwise_weights_too(groups):
    # (their families scale the taps as they convert them to float32)
    model = randomise_bn(nn.Sequential(nn.Conv2d(8, 8, 3, padding=1, groups=groups, bias=False),
                                       nn.BatchNorm2d(8))).eval().to(torch.bfloat16)
    w = model[0].weight.detach().clone()
    x = torch.randn(2, 8, 12, 12, generator=torch.Generator().manual_seed(1)).bfloat16()
    with torch.no_grad():
        exact = copy.deepcopy(model).double()(x.double())
    kernelgen.convert(model, fold_bn=True)
    assert torch.equal(model[0].weight.view(torch.int16), w.view(torch.int16))
    assert model[0].bn_scale.dtype == torch.float32 and model[0].bias is not None
    with torch.no_grad():
        out = model(x)
    assert (out.double() - exact).norm() / exact.norm() < 2 ** -7  # (one bf16 rounding of the output)


def test_tune_tunes_the_call_a_scaled_layer_makes(monkeypatch):
    # a 16-bit layer with a folded BatchNorm calls kernelgen.conv2d with its scale: that call is tuned
    model = randomise_bn(nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False),
                                       nn.BatchNorm2d(8))).eval().to(torch.bfloat16)
    seen = []
    monkeypatch.setattr(tuner, "tune_calls", lambda calls, **kw: seen.extend(calls))
    kernelgen.convert(model, fold_bn=True, example_inputs=_x(torch.bfloat16), tune=True)
    (call,) = seen
    assert call["scale"] is model[0].bn_scale
