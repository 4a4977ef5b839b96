"""kernelgen.convert(model, fuse=True): each convolution's following residual add and activation in
its call (kernelgen.conv2d's epilogue), on small models.

The calls go to kernelgen.conv2d with its epilogue; the `calls` fixture records each call's
epilogue. Outputs are held to docs' accuracy rules against the unfused model in float64.
"""

from __future__ import annotations

import copy
import gc
import json
import logging
import pickle
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kernelgen
import kernelgen.conversion
import kernelgen.functional
import kernelgen.nn
from kernelgen import tuner
from model_state import assert_same_state, randomise_bn, snapshot

pytestmark = pytest.mark.compile  # with the kernel side merged, the fused calls build real kernels

ACTIVATIONS = kernelgen.ACTIVATIONS


def conv2d_with_epilogue():
    """kernelgen.conv2d, which takes the epilogue."""
    return kernelgen.functional.conv2d


@pytest.fixture
def calls(monkeypatch) -> list[dict]:
    """Every kernelgen.conv2d call's epilogue, in order: {"activation", "negative_slope", "residual"}
    (the residual as (shape, dtype))."""
    target, log = conv2d_with_epilogue(), []

    def recording(*args, **kwargs):
        r = kwargs.get("residual")
        log.append({"activation": kwargs.get("activation"), "negative_slope": kwargs.get("negative_slope", 0.01),
                    "residual": None if r is None else (tuple(r.shape), r.dtype)})
        return target(*args, **kwargs)

    for module in (kernelgen, kernelgen.nn, kernelgen.conversion):
        monkeypatch.setattr(module, "conv2d", recording)
    return log


# --- helpers ------------------------------------------------------------------------------------------

def _build(cls, *args, seed=0, **kwargs):
    torch.manual_seed(seed)
    return randomise_bn(cls(*args, **kwargs)).eval()


def _x(c=8, n=2, hw=12, seed=1, dtype=torch.float32):
    return torch.randn(n, c, hw, hw, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def _assert_accurate(out, unfused, *inputs):
    """The networks' accuracy rule (docs/performance.md): ‖out − y64‖ / ‖y64‖ against the unfused model run in float64 on the same
    inputs, at most 1e-5 for float32 (exact on the CPU) and 1e-12 for float64."""
    model64 = copy.deepcopy(unfused).double()
    with torch.no_grad():
        y64 = model64(*(t.double() for t in inputs))
    assert out.shape == y64.shape
    err = ((out.double() - y64).norm() / y64.norm()).item()
    assert err <= (1e-12 if out.dtype == torch.float64 else 1e-5), err


def _fused(model):
    return {r["name"]: r["fused"] for r in kernelgen.report(model).rows if r["fused"] is not None}


# --- models -------------------------------------------------------------------------------------------

def conv_bn_relu():
    return nn.Sequential(nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(inplace=True),
                         nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU6())


class Bottleneck(nn.Module):
    """torchvision's resnet Bottleneck, by hand: `identity = self.downsample(x)` is computed after
    conv3, and added in place (`out += identity`)."""

    def __init__(self, cin, width, stride=1):
        super().__init__()
        cout = width * 4
        self.conv1 = nn.Conv2d(cin, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, cout, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)  # one instance, applied three times
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        if self.downsample is not None:
            identity = self.downsample(x)
        out += identity
        out = self.relu(out)
        return out


class TinyResNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(8)
        self.relu = nn.ReLU(inplace=True)
        self.layer1 = nn.Sequential(Bottleneck(8, 2), Bottleneck(8, 4, stride=2), Bottleneck(16, 4))

    def forward(self, x):
        return self.layer1(self.relu(self.bn1(self.conv1(x))))


class InvertedResidual(nn.Module):
    """torchvision's MobileNet inverted residual, by hand: expand, depthwise (SiLU or Hardswish),
    project, then `x + self.conv(x)` with no activation after the add."""

    def __init__(self, c, expand, act):
        super().__init__()
        hidden = c * expand
        self.conv = nn.Sequential(
            nn.Sequential(nn.Conv2d(c, hidden, 1, bias=False), nn.BatchNorm2d(hidden), act()),
            nn.Sequential(nn.Conv2d(hidden, hidden, 3, 1, 1, groups=hidden, bias=False), nn.BatchNorm2d(hidden),
                          act()),
            nn.Conv2d(hidden, c, 1, bias=False), nn.BatchNorm2d(c))

    def forward(self, x):
        return x + self.conv(x)


class MobileBlocks(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.Sequential(InvertedResidual(8, 2, nn.SiLU), InvertedResidual(8, 3, nn.Hardswish))

    def forward(self, x):
        return self.blocks(x)


class Untraceable(nn.Module):
    """Control flow on a tensor's value: torch.fx cannot trace it; fusion by nn.Sequential patterns.
    Its residual add is in forward, where module patterns do not look."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
                                  nn.Conv2d(8, 8, 3, padding=1), nn.LeakyReLU(0.2))
        self.body = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.Identity(), nn.GELU(),
                                  nn.Conv2d(8, 8, 1), nn.Hardtanh(0.0, 6.0), nn.Conv2d(8, 8, 1), nn.Tanh())

    def forward(self, x):
        y = self.stem(x)
        y = self.body(y) + y
        return y if bool(y.sum() > -1e30) else -y


# --- what gets fused ----------------------------------------------------------------------------------

def test_conv_bn_relu_sequential_becomes_fused_convs(calls):
    model, x = _build(conv_bn_relu), _x()
    unfused = copy.deepcopy(model)
    state = snapshot(model)
    assert kernelgen.convert(model, x, fold_bn=True, fuse=True) is model  # in place, like every convert
    assert type(model) is nn.Sequential and isinstance(model.forward, kernelgen.conversion.FusedForward)
    assert [type(m) for m in model] == [kernelgen.Conv2d, nn.Identity, nn.ReLU, kernelgen.Conv2d, nn.Identity,
                                        nn.ReLU6]  # no module removed: the activations are skipped where fused
    assert _fused(model) == {"0": "relu", "3": "relu6"}
    assert set(model.state_dict()) == {k for k in state if not k.startswith(("1.", "4."))} | {"0.bias", "3.bias"}
    calls.clear()
    with torch.no_grad():
        out = model(x)
    assert [c["activation"] for c in calls] == ["relu", "relu6"]
    _assert_accurate(out, unfused, x)


def test_bottleneck_residual_after_the_conv_in_program_order(calls):
    model, x = _build(TinyResNet), _x(3)
    unfused = copy.deepcopy(model)
    kernelgen.convert(model, x, fold_bn=True, fuse=True)
    assert _fused(model) == {
        "conv1": "relu", "layer1.0.conv1": "relu", "layer1.0.conv2": "relu", "layer1.0.conv3": "+residual, relu",
        "layer1.1.conv1": "relu", "layer1.1.conv2": "relu", "layer1.1.conv3": "+residual, relu",
        "layer1.2.conv1": "relu", "layer1.2.conv2": "relu", "layer1.2.conv3": "+residual, relu"}
    code = model.forward.code
    # block 1's fused conv3 is called where its residual (the downsample's output) exists
    assert code.index('getattr(self.layer1, "1").downsample') < code.index('getattr(self.layer1, "1").conv3')
    assert code.count("'iadd')") == 3  # `out += identity`: torch's in-place add where the kernel cannot take it
    calls.clear()
    with torch.no_grad():
        out = model(x)
    residuals = [c["residual"] for c in calls if c["residual"] is not None]
    assert residuals == [((2, 8, 12, 12), torch.float32), ((2, 16, 6, 6), torch.float32),
                         ((2, 16, 6, 6), torch.float32)]
    assert len(calls) == 11  # ten fused convolutions and the downsample's, all through kernelgen.conv2d
    _assert_accurate(out, unfused, x)
    text = str(kernelgen.report(model))
    assert "+residual, relu" in text and text.splitlines()[-1].endswith("11 with BatchNorm folded, 10 fused")


def test_inverted_residual_depthwise_with_no_activation_after_the_add(calls):
    model, x = _build(MobileBlocks), _x()
    unfused = copy.deepcopy(model)
    kernelgen.convert(model, fold_bn=True, fuse=True)
    assert _fused(model) == {
        "blocks.0.conv.0.0": "silu", "blocks.0.conv.1.0": "silu", "blocks.0.conv.2": "+residual",
        "blocks.1.conv.0.0": "hardswish", "blocks.1.conv.1.0": "hardswish", "blocks.1.conv.2": "+residual"}
    calls.clear()
    with torch.no_grad():
        out = model(x)
    assert [c["activation"] for c in calls] == ["silu", "silu", None, "hardswish", "hardswish", None]
    assert calls[2]["residual"] == ((2, 8, 12, 12), torch.float32)
    _assert_accurate(out, unfused, x)


def test_untraceable_model_fuses_by_sequential_patterns(calls):
    model, x = _build(Untraceable), _x()
    with pytest.raises(Exception):
        torch.fx.symbolic_trace(model)
    unfused = copy.deepcopy(model)
    kernelgen.convert(model, fold_bn=True, fuse=True)
    assert "forward" not in model.__dict__  # the model's own forward runs; its Sequentials' are fused
    assert isinstance(model.stem.forward, kernelgen.conversion.FusedForward)
    assert _fused(model) == {"stem.0": "relu", "stem.3": "leaky_relu(0.2)", "body.0": "gelu", "body.3": "relu6"}
    calls.clear()
    with torch.no_grad():
        out = model(x)
    assert [(c["activation"], c["negative_slope"]) for c in calls] == [
        ("relu", 0.01), ("leaky_relu", 0.2), ("gelu", 0.01), ("relu6", 0.01), (None, 0.01)]  # Tanh: not fused
    assert all(c["residual"] is None for c in calls)  # the add in forward: no module pattern
    _assert_accurate(out, unfused, x)


class Act(nn.Module):
    """conv -> activation, and conv -> add -> activation, with the activation given as a callable."""

    def __init__(self, act):
        super().__init__()
        self.a, self.b = nn.Conv2d(8, 8, 3, padding=1), nn.Conv2d(8, 8, 3, padding=1)
        self.act = act

    def forward(self, x):
        return self.act(self.b(self.act(self.a(x))) + x)


FORMS = [  # (activation, negative_slope, a callable in one of the forms torch.fx records)
    ("relu", 0.01, nn.ReLU()), ("relu", 0.01, nn.ReLU(inplace=True)), ("relu", 0.01, F.relu),
    ("relu", 0.01, torch.relu), ("relu", 0.01, torch.relu_), ("relu", 0.01, lambda y: F.relu(y, inplace=True)),
    ("relu", 0.01, lambda y: y.relu()), ("relu", 0.01, lambda y: y.relu_()),
    ("relu6", 0.01, nn.ReLU6()), ("relu6", 0.01, nn.Hardtanh(0.0, 6.0)), ("relu6", 0.01, F.relu6),
    ("relu6", 0.01, lambda y: F.hardtanh(y, 0.0, 6.0)), ("relu6", 0.01, lambda y: F.hardtanh_(y, 0, 6)),
    ("leaky_relu", 0.01, nn.LeakyReLU()), ("leaky_relu", 0.2, nn.LeakyReLU(0.2, inplace=True)),
    ("leaky_relu", 0.01, F.leaky_relu), ("leaky_relu", 0.3, lambda y: F.leaky_relu(y, 0.3)),
    ("leaky_relu", 0.1, lambda y: F.leaky_relu_(y, 0.1)),
    ("silu", 0.01, nn.SiLU()), ("silu", 0.01, nn.SiLU(inplace=True)), ("silu", 0.01, F.silu),
    ("gelu", 0.01, nn.GELU()), ("gelu", 0.01, F.gelu), ("gelu", 0.01, lambda y: F.gelu(y, approximate="none")),
    ("hardswish", 0.01, nn.Hardswish()), ("hardswish", 0.01, F.hardswish),
    ("hardsigmoid", 0.01, nn.Hardsigmoid()), ("hardsigmoid", 0.01, lambda y: F.hardsigmoid(y, inplace=True)),
    ("sigmoid", 0.01, nn.Sigmoid()), ("sigmoid", 0.01, torch.sigmoid), ("sigmoid", 0.01, F.sigmoid),
    ("sigmoid", 0.01, lambda y: y.sigmoid_()),
]


@pytest.mark.parametrize("activation, slope, act", FORMS, ids=lambda v: v if isinstance(v, str) else None)
def test_every_activation_form(calls, activation, slope, act):
    model, x = _build(Act, act), _x()
    unfused = copy.deepcopy(model)
    kernelgen.convert(model, fuse=True)
    calls.clear()
    with torch.no_grad():
        out = model(x)
    assert [(c["activation"], c["negative_slope"], c["residual"]) for c in calls] == [
        (activation, slope, None), (activation, slope, ((2, 8, 12, 12), torch.float32))]
    assert activation in ACTIVATIONS and kernelgen.conversion.TORCH_ACTIVATIONS.keys() == set(ACTIVATIONS)
    _assert_accurate(out, unfused, x)


@pytest.mark.parametrize("act", [nn.GELU(approximate="tanh"), lambda y: F.gelu(y, approximate="tanh"),
                                 nn.Hardtanh(), nn.Tanh(), nn.ELU(), nn.PReLU()],
                         ids=["GELU-tanh", "gelu-tanh", "Hardtanh", "Tanh", "ELU", "PReLU"])
def test_activations_the_kernels_do_not_have_stay_in_torch(calls, act):
    model, x = _build(Act, act), _x()
    unfused = copy.deepcopy(model)
    kernelgen.convert(model, fuse=True)
    assert _fused(model) == {"b": "+residual"}
    with torch.no_grad():
        _assert_accurate(model(x), unfused, x)


# --- what must not be fused -----------------------------------------------------------------------

class Shapes(nn.Module):
    """Sites that must not be fused, or only partly: each returns a value or reads one that makes
    fusing the next step wrong."""

    def __init__(self):
        super().__init__()
        self.c = nn.ModuleList(nn.Conv2d(8, 8, 3, padding=1) for _ in range(7))
        self.relu = nn.ReLU()

    def forward(self, x):
        c = self.c
        y0 = c[0](x)
        a = self.relu(y0) + y0.mean()  # y0 read twice: nothing fused
        y1 = c[1](x) + x
        b = self.relu(y1) * y1  # the add's output read twice: the add fused, not the relu
        r = x * 2
        r += c[2](x)  # adds in place into the residual, not into the conv's output: not fused
        d = torch.add(c[3](x), x, alpha=2.0)  # not a plain add
        y4 = c[4](x)
        x2 = x.clone()
        x2.mul_(3)  # changes a tensor in place between the conv and its add: the add stays apart
        e = y4 + x2
        f = self.relu(c[5](x) + c[5](x))  # a conv called twice, each site on its own
        g = c[6](x) + 1.0  # a number, not a tensor: not fused
        return a + b + r + d + e + f + g


def test_outputs_read_elsewhere_in_place_residuals_and_mutations_are_not_fused(calls):
    model, x = _build(Shapes), _x()
    unfused = copy.deepcopy(model)
    kernelgen.convert(model, fuse=True)
    assert _fused(model) == {"c.1": "+residual", "c.5": "+residual, relu"}
    calls.clear()
    with torch.no_grad():
        out = model(x)
    assert [c["residual"] is not None for c in calls] == [False, True, False, False, False, False, True, False]
    assert [c["activation"] for c in calls] == [None] * 6 + ["relu", None]
    _assert_accurate(out, unfused, x)


class SharedAct(nn.Module):
    """One nn.ReLU instance after a conv in two Sequentials and on a value no conv makes."""

    def __init__(self):
        super().__init__()
        relu = nn.ReLU()
        self.a = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), relu)
        self.b = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), relu, relu, nn.Conv2d(8, 8, 1))
        self.relu = relu

    def forward(self, x, untraceable=False):
        if untraceable and bool(x.sum() > -1e30):
            x = x * 1.0
        y = self.b(self.a(x))
        return self.relu(y - 0.5)  # the shared instance on something no conv produced


@pytest.mark.parametrize("traced", [True, False])
def test_shared_activation_instances_are_fused_per_call_site(calls, traced, monkeypatch):
    model, x = _build(SharedAct), _x()
    unfused = copy.deepcopy(model)
    if not traced:
        monkeypatch.setattr(kernelgen.conversion, "_trace_for_fusion", lambda m: None)
    kernelgen.convert(model, fuse=True)
    assert isinstance(model.relu, nn.ReLU) and model.a[1] is model.relu and model.b[2] is model.relu
    assert _fused(model) == {"a.0": "relu", "b.0": "relu"}
    calls.clear()
    with torch.no_grad():
        out = model(x)
        _assert_accurate(out, unfused, x)
        _assert_accurate(model(x, True), unfused, x)  # an optional argument given: the class's forward
    assert [c["activation"] for c in calls[:3]] == ["relu", "relu", None]


def test_hooked_modules_are_not_fused(calls):
    model, x = _build(conv_bn_relu), _x()
    seen = []
    model[0].register_forward_hook(lambda m, i, o: seen.append(o.min().item()))  # wants the conv's own output
    model[5].register_forward_pre_hook(lambda m, i: seen.append("relu6"))  # would not run if skipped
    unfused = copy.deepcopy(model)
    kernelgen.convert(model, fold_bn=True, fuse=True)
    assert _fused(model) == {}
    with torch.no_grad():
        out = model(x)
    assert seen[0] < 0 and seen[1] == "relu6"
    _assert_accurate(out, unfused, x)


# --- run time: residuals the kernel cannot take ------------------------------------------------------

class Broadcast(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(8, 8, 3, padding=1)
        self.shift = nn.Parameter(torch.randn(1, 8, 1, 1))

    def forward(self, x):
        return F.silu(self.conv(x) + self.shift)


def test_a_broadcast_residual_is_added_by_torch_after_kernelgens_conv(calls, caplog):
    model, x = _build(Broadcast), _x()
    unfused = copy.deepcopy(model)
    kernelgen.convert(model, fuse=True)
    assert _fused(model) == {"conv": "+residual, silu"}
    before = kernelgen.stats().get("epilogues_in_torch", 0)
    calls.clear()
    with torch.no_grad(), caplog.at_level(logging.INFO, logger="kernelgen"):
        out = model(x)
        model(x)
    assert calls == [{"activation": None, "negative_slope": 0.01, "residual": None}] * 2  # the conv: kernelgen's
    assert kernelgen.stats()["epilogues_in_torch"] == before + 2
    assert sum("residual its kernel cannot take" in r.getMessage() for r in caplog.records) == 1  # once a layer
    row = kernelgen.report(model).rows[0]
    assert row["epilogue_in_torch"] == 2 and "+residual, silu (torch ×2)" in str(kernelgen.report(model))
    _assert_accurate(out, unfused, x)


class Basic(nn.Module):
    """A BasicBlock without downsample: the residual is the block's input, in its own dtype."""

    def __init__(self, inplace):
        super().__init__()
        self.inplace = inplace
        self.conv1, self.conv2 = nn.Conv2d(8, 8, 3, padding=1), nn.Conv2d(8, 8, 3, padding=1)

    def forward(self, x):
        out = self.conv2(F.relu(self.conv1(x)))
        if self.inplace:
            out += x
        else:
            out = out + x
        return F.relu(out)


@pytest.mark.parametrize("inplace", [True, False])
def test_autocast_residual_of_another_dtype_keeps_torchs_semantics(calls, inplace):
    model, x = _build(Basic, inplace), _x()
    unfused = copy.deepcopy(model)
    kernelgen.convert(model, fuse=True)
    assert _fused(model) == {"conv1": "relu", "conv2": "+residual, relu"}
    calls.clear()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(x)
        ref = unfused(x)
    # `out += x` keeps the conv output's bfloat16; `out + x` promotes to float32: as torch does
    assert out.dtype == ref.dtype == (torch.bfloat16 if inplace else torch.float32)
    assert [(c["activation"], c["residual"]) for c in calls] == [("relu", None), (None, None)]
    assert kernelgen.report(model).rows[1]["epilogue_in_torch"] == 1
    with torch.no_grad():
        exact = copy.deepcopy(unfused).double()(x.double())
    # bfloat16's rule: no further from float64 than 1.5x torch's own bfloat16 error
    err, own = ((t.double() - exact).norm() / exact.norm() for t in (out, ref))
    assert err <= 1.5 * own, (err, own)
    calls.clear()
    with torch.no_grad():  # outside autocast the residual fits: fused again
        model(x)
    assert calls[1]["residual"] == ((2, 8, 12, 12), torch.float32)


# --- modes, arguments, the model's life ----------------------------------------------------------------

def test_fuse_needs_eval_mode_and_training_mode_runs_unfused(calls):
    model = _build(TinyResNet).train()
    state = snapshot(model)
    with pytest.raises(ValueError, match="fuse=True needs the model in eval mode"):
        kernelgen.convert(model, fuse=True)
    assert not any(hasattr(m, "kernelgen_layer") for m in model.modules())
    assert_same_state(model.state_dict(), state)
    model.eval()
    kernelgen.convert(model, fuse=True)
    model.train()
    calls.clear()
    x = _x(3)
    with torch.no_grad():
        model(x)
    assert len(calls) == 11 and all(c["activation"] is None and c["residual"] is None for c in calls)


class Optional(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(8, 8, 3, padding=1)

    def forward(self, x, scale=None, shift=0.0):
        y = self.conv(x)
        if scale is not None:
            y = y * scale
        return F.relu(y) + shift


def test_optional_arguments_other_than_their_defaults_run_the_class_forward(calls):
    model, x = _build(Optional), _x()
    unfused = copy.deepcopy(model)
    kernelgen.convert(model, fuse=True)  # traced with scale=None, shift=0.0
    assert _fused(model) == {"conv": "relu"}
    with torch.no_grad():
        for args, kwargs, fused in [((x,), {}, True), ((x, None), {}, True), ((x,), {"shift": 0.0}, True),
                                    ((), {"x": x}, True), ((x, 2.0), {}, False), ((x,), {"shift": 1.5}, False)]:
            calls.clear()
            torch.testing.assert_close(model(*args, **kwargs), unfused(*args, **kwargs), rtol=1e-5, atol=1e-5)
            assert calls[0]["activation"] == ("relu" if fused else None), (args, kwargs)


def test_convert_twice_and_report_once(calls):
    model, x = _build(TinyResNet), _x(3)
    kernelgen.convert(model, fold_bn=True, fuse=True)
    code = model.forward.code
    kernelgen.convert(model, x, fold_bn=True, fuse=True)
    assert model.forward.code == code
    assert model.layer1[0].conv3.kernelgen_layer.fused == ["+residual, relu"]


def test_revert_round_trip_is_bit_identical_and_keeps_state(calls):
    model, x = _build(TinyResNet), _x(3)
    with torch.no_grad():
        ref = model(x)
    state = snapshot(model)
    kernelgen.convert(model, x, fuse=True)  # (no fold_bn, which revert does not undo)
    assert_same_state(model.state_dict(), state)  # fusing alone changes no parameter or key
    assert kernelgen.revert(model) is model
    assert "forward" not in model.__dict__ and type(model.layer1[0].conv3) is nn.Conv2d
    assert not any(isinstance(m.__dict__.get("forward"), kernelgen.conversion.FusedForward)
                   for m in model.modules())
    assert_same_state(model.state_dict(), state)
    with torch.no_grad():
        assert torch.equal(model(x), ref)


def test_fused_model_pickles_deep_copies_and_frees(calls, tmp_path):
    model, x = _build(TinyResNet), _x(3)
    kernelgen.convert(model, x, fold_bn=True, fuse=True)
    with torch.no_grad():
        ref = model(x)
    torch.save(model, tmp_path / "model.pt")
    loaded = torch.load(tmp_path / "model.pt", weights_only=False)
    for m in (loaded, copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert m.forward._owner() is m and m.forward.code == model.forward.code
        with torch.no_grad():
            assert torch.equal(m(x), ref)
        kernelgen.revert(m)
        assert "forward" not in m.__dict__
    # the fused forward holds its model weakly: no cycle keeps a dropped model (and its memory) alive
    gc.disable()
    try:
        alive = weakref.ref(model)
        del model, m, loaded
        assert alive() is None
    finally:
        gc.enable()


def test_a_layer_falling_back_to_torch_computes_its_epilogue_with_torch(calls, monkeypatch):
    model, x = _build(Basic, True), _x()
    unfused = copy.deepcopy(model)
    monkeypatch.setattr(tuner, "_stream_us", lambda fns, cuda=True: [9.0, 3.0])  # kernelgen measured slower
    kernelgen.convert(model, x, fuse=True, fallback="torch")
    assert type(model.conv2) is nn.Conv2d and model.conv2.kernelgen_layer.fallback == "torch"
    calls.clear()
    with torch.no_grad():
        out = model(x)
    assert calls == []  # both layers on torch, as measured
    assert kernelgen.report(model).rows[1]["fused"] == "+residual, relu"
    _assert_accurate(out, unfused, x)


class ResidualRelu(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(8, 8, 3, padding=1)

    def forward(self, x):
        return F.relu(self.conv(x) + x)


def test_tune_tunes_the_fused_call_and_the_fused_forward_serves_it(fresh_cache, monkeypatch):
    from kernelgen import functional, plans

    model, x = _build(ResidualRelu), _x()
    unfused = copy.deepcopy(model)
    # cpu_direct's two configurations; the second (cout_block 4) made to look faster
    monkeypatch.setattr(tuner, "_stream_us", lambda fns, cuda=True: [2.0, 1.0][:len(fns)])
    tuned, real = [], tuner.tune_calls
    monkeypatch.setattr(tuner, "tune_calls", lambda calls, **kw: tuned.extend(calls) or real(calls, **kw))
    before = kernelgen.stats()
    kernelgen.convert(model, x, fuse=True, tune=True)
    (call,) = tuned
    assert call["activation"] == "relu" and call["residual"] is not None
    assert call["residual"].data_ptr() == x.data_ptr()  # the model's own residual at the example inputs
    assert kernelgen.stats().get("tune_timings", 0) - before.get("tune_timings", 0) == 2  # both candidates
    sig = functional.signature(x, model.conv.weight, model.conv.bias, (1, 1), (1, 1), (1, 1), 1, None, None, None,
                               "relu", x)
    record = plans.read(fresh_cache, functional._record_name(sig, x))
    assert json.loads(record["tuned"]["spec"])["tiles"] == {"cout_block": 4}
    bare = functional.signature(x, model.conv.weight, model.conv.bias, (1, 1), (1, 1), (1, 1), 1, None, None, None)
    assert "tuned" not in (plans.read(fresh_cache, functional._record_name(bare, x)) or {})
    row = kernelgen.report(model).rows[0]
    assert row["kernel"] == "cpu_direct[cout_block=4] (tuned)" and row["epilogue"] == "+residual, relu"
    assert (row["us"], row["torch_us"], row["fallback"]) == (2.0, 1.0, None)
    assert str(kernelgen.report(model)).splitlines()[-1].startswith("µs of a fused layer are its whole call")
    # the fused forward runs the tuned record's kernel: nothing built, nothing timed
    before = kernelgen.stats()
    with torch.no_grad():
        out = model(x)
    after = kernelgen.stats()
    assert functional._plans[sig].key == record["key"]
    assert after["compiles"] == before["compiles"] and after.get("tune_timings") == before.get("tune_timings")
    _assert_accurate(out, unfused, x)


def _timing_spy(times):
    """A tuner._stream_us for convert's timings: each pair of functions run once (kernelgen's, torch's
    outputs kept), then reported as the next of `times`."""
    seen = []

    def stream_us(fns, cuda=True):
        with torch.no_grad():
            seen.append([fn() for fn in fns])
        return times[len(seen) - 1]

    return stream_us, seen


def test_fallback_times_the_fused_call_against_torchs_conv_add_and_activation(calls, monkeypatch, caplog):
    model, x = _build(Basic, True), _x()
    unfused = copy.deepcopy(model)
    with torch.no_grad():
        ref = unfused(x)
        y1 = F.relu(unfused.conv1(x))
        y2 = F.relu(unfused.conv2(y1) + x)
    stream_us, seen = _timing_spy([[9.0, 3.0], [9.0, 3.0]])  # kernelgen measured slower: every layer falls back
    monkeypatch.setattr(tuner, "_stream_us", stream_us)
    before = kernelgen.stats().get("convert_fallbacks", 0)
    calls.clear()
    with caplog.at_level(logging.INFO, logger="kernelgen"):
        kernelgen.convert(model, x, fuse=True, fallback="torch")
    # recorded and timed as fused: kernelgen's side the fused call, torch's F.conv2d, the add, the relu
    assert [(c["activation"], c["residual"]) for c in calls] == [
        ("relu", None), ("relu", ((2, 8, 12, 12), torch.float32))] * 2
    assert len(seen) == 2
    for (kg, th), want in zip(seen, (y1, y2)):
        torch.testing.assert_close(kg, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(th, want, rtol=1e-6, atol=1e-6)
    assert type(model.conv1) is type(model.conv2) is nn.Conv2d
    assert kernelgen.stats()["convert_fallbacks"] == before + 2
    assert any("conv2 keeps torch's convolution: kernelgen 9.0 us > F.conv2d then +residual, relu by torch 3.0 us"
               in r.getMessage() for r in caplog.records)
    rows = kernelgen.report(model).rows
    assert [(r["fallback"], r["epilogue"], r["us"], r["torch_us"]) for r in rows] == [
        ("torch", "relu", 9.0, 3.0), ("torch", "+residual, relu", 9.0, 3.0)]
    text = str(kernelgen.report(model)).splitlines()
    assert text[-2] == "2 layer(s): 0 on kernelgen, 2 on torch (fallback), 0 with BatchNorm folded, 2 fused"
    assert text[-1].startswith("µs of a fused layer are its whole call")
    calls.clear()
    with torch.no_grad():
        out = model(x)
    assert calls == []  # both layers on torch, their epilogues too
    torch.testing.assert_close(out, ref)
    _assert_accurate(out, unfused, x)


def test_a_fused_and_a_bare_call_of_one_shape_are_timed_apart(calls, monkeypatch):
    model = _build(lambda: nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1)))
    x = _x()
    unfused = copy.deepcopy(model)
    stream_us, seen = _timing_spy([[9.0, 3.0], [2.0, 3.0]])  # the fused one (recorded first) slower
    monkeypatch.setattr(tuner, "_stream_us", stream_us)
    kernelgen.convert(model, x, fuse=True, fallback="torch")
    assert len(seen) == 2  # one shape, two plans: timed once each
    assert bool((seen[0][1] >= 0).all()) and bool((seen[1][1] < 0).any())  # torch's side: relu, then none
    rows = kernelgen.report(model).rows
    assert [(r["name"], r["epilogue"], r["us"], r["fallback"]) for r in rows] == [
        ("0", "relu", 9.0, "torch"), ("2", None, 2.0, None)]
    assert type(model[0]) is nn.Conv2d and type(model[2]) is kernelgen.Conv2d
    calls.clear()
    with torch.no_grad():
        out = model(x)
    assert calls == [{"activation": None, "negative_slope": 0.01, "residual": None}]  # the second layer's
    _assert_accurate(out, unfused, x)


def test_report_shows_the_fused_column():
    model = _build(conv_bn_relu)
    kernelgen.convert(model, fold_bn=True, fuse=True)
    lines = str(kernelgen.report(model)).splitlines()
    assert lines[0].split() == ["layer", "input", "kernel", "bn", "folded", "fused", "fallback", "kernelgen", "µs",
                                "F.conv2d", "µs"]
    assert lines[2].split()[:5] == ["0", "-", "-", "1", "relu"]
    assert lines[3].split()[:5] == ["3", "-", "-", "4", "relu6"]
    assert lines[-1] == "2 layer(s): 2 on kernelgen, 0 on torch (fallback), 2 with BatchNorm folded, 2 fused"
    assert [r["fused"] for r in kernelgen.report(model).rows] == ["relu", "relu6"]


def test_a_model_with_a_forward_of_its_own_is_not_traced(calls):
    model, x = _build(conv_bn_relu), _x()
    model.forward = lambda t: nn.Sequential.forward(model, t) * 2  # an instance forward, e.g. a wrapper's
    with torch.no_grad():
        ref = model(x)
    kernelgen.convert(model, fold_bn=True, fuse=True)
    assert not isinstance(model.forward, kernelgen.conversion.FusedForward)  # its class's is not what it runs
    assert _fused(model) == {}
    with torch.no_grad():
        torch.testing.assert_close(model(x), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning")
def test_torch_compile_and_jit_trace_run_the_fused_forward(calls):
    model, x = _build(TinyResNet), _x(3)
    kernelgen.convert(model, fold_bn=True, fuse=True)
    with torch.no_grad():
        ref = model(x)
        calls.clear()
        traced = torch.jit.trace(model, x, check_trace=False)
        assert [c["activation"] for c in calls][:2] == ["relu", "relu"]  # traced through the fused calls
        torch.testing.assert_close(traced(x), ref, rtol=1e-5, atol=1e-5)
        compiled = torch.compile(model, backend="eager", fullgraph=True)
        torch.testing.assert_close(compiled(x), ref, rtol=1e-5, atol=1e-5)


def test_conversion_knows_every_activation_the_kernels_take():
    from kernelgen.conversion import TORCH_ACTIVATIONS

    assert set(TORCH_ACTIVATIONS) == set(kernelgen.ACTIVATIONS)
