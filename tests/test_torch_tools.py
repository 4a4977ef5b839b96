"""Compile tier: PyTorch's tools around an eager call (FakeTensorMode, vmap, FlopCounterMode, the
profiler, TorchScript, ONNX export) see kernelgen.conv2d as they see F.conv2d; on the CPU family."""

from __future__ import annotations

import os
import subprocess
import sys
from importlib import import_module

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

import kernelgen
from kernelgen.functional import spec_for

pytestmark = pytest.mark.compile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def close(y, ref):
    return y.shape == ref.shape and ((y.double() - ref.double()).norm() / ref.double().norm()).item() <= 1e-5


def _model(**kw):
    torch.manual_seed(0)
    return torch.nn.Sequential(kernelgen.Conv2d(4, 8, 3, padding=1, **kw), torch.nn.ReLU(),
                               kernelgen.Conv2d(8, 6, (3, 5), stride=(2, 1), padding="valid", groups=2)).eval()


# FakeTensorMode: an eager call read FakeTensors' (absent) memory and crashed the process, so the
# test runs in a child process of its own.
FAKE = r"""
import torch, kernelgen
from torch._subclasses.fake_tensor import FakeTensorMode
before = kernelgen.stats()["compiles"]
real = torch.randn(6, 4, 3, 3)
with FakeTensorMode() as mode:
    for x in (torch.randn(2, 4, 8, 8), torch.randn(2, 4, 8, 8).contiguous(memory_format=torch.channels_last),
              torch.randn(4, 9, 7, dtype=torch.float64)):
        m = kernelgen.Conv2d(4, 6, 3, padding=1, dtype=x.dtype)
        with torch.no_grad():
            y = m(x)
        ref = torch.nn.functional.conv2d(x, m.weight, m.bias, padding=1)
        assert type(y).__name__ == "FakeTensor", type(y)
        assert (y.shape, y.dtype, y.stride()) == (ref.shape, ref.dtype, ref.stride()), (y.stride(), ref.stride())
    y = kernelgen.conv2d(mode.from_tensor(torch.randn(1, 4, 5, 5)), mode.from_tensor(torch.randn(8, 2, 3, 3)),
                         stride=2, groups=2)
    assert y.shape == (1, 8, 2, 2)
    try:  # a real weight in a fake call: FakeTensorMode's own error, not a read of fake memory
        kernelgen.conv2d(mode.from_tensor(torch.randn(1, 4, 8, 8)), real)
        raise AssertionError("no error")
    except Exception as e:
        assert "FakeTensor" in str(e), e
assert kernelgen.stats()["compiles"] == before
print("ok")
"""


def test_fake_tensor_mode_gives_a_fake_output_without_a_kernel():
    p = subprocess.run([sys.executable, "-c", FAKE], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, PYTHONPATH=ROOT))
    assert p.returncode == 0 and p.stdout.strip() == "ok", (p.returncode, p.stderr[-2000:])


@pytest.mark.parametrize("case", ["batched", "unbatched samples", "in_dims=1", "channels_last", "weights"])
def test_vmap_matches_f_conv2d(case):
    torch.manual_seed(0)
    w, b = torch.randn(6, 4, 3, 3), torch.randn(6)
    kw = dict(stride=(2, 1), padding=1)
    in_dims, xs = 0, torch.randn(3, 2, 4, 9, 8)
    if case == "unbatched samples":
        xs = torch.randn(3, 4, 9, 8)
    elif case == "in_dims=1":
        in_dims, xs = 1, torch.randn(2, 3, 4, 9, 8)
    elif case == "channels_last":
        xs = torch.randn(3 * 2, 4, 9, 8).contiguous(memory_format=torch.channels_last).unflatten(0, (3, 2))
    if case == "weights":
        ws = torch.randn(3, 6, 4, 3, 3)
        y = torch.vmap(lambda x, w: kernelgen.conv2d(x, w, b, **kw))(xs, ws)
        ref = torch.vmap(lambda x, w: F.conv2d(x, w, b, **kw))(xs, ws)
    else:
        y = torch.vmap(lambda x: kernelgen.conv2d(x, w, b, **kw), in_dims=in_dims)(xs)
        ref = torch.vmap(lambda x: F.conv2d(x, w, b, **kw), in_dims=in_dims)(xs)
    assert close(y, ref)


@pytest.mark.parametrize("x", [torch.randn(2, 4, 16, 16), torch.randn(4, 16, 16)], ids=["batched", "unbatched"])
def test_flop_counter_counts_as_for_nn_conv2d(x):
    theirs = torch.nn.Sequential(torch.nn.Conv2d(4, 8, 3, padding=1), torch.nn.ReLU(),
                                 torch.nn.Conv2d(8, 6, (3, 5), stride=(2, 1), groups=2))
    counts = []
    for m in (theirs, _model()):
        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            m(x)
        counts.append(counter.get_total_flops())
    assert counts[0] > 0 and counts[1] == counts[0]


def test_profiler_shows_a_range_per_call_naming_its_family():
    m = _model()
    x = torch.randn(2, 4, 16, 16)
    with torch.no_grad():
        eager = m(x)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            y = m(x)
    events = prof.events()
    assert [e.name for e in events].count("kernelgen::conv2d") == 2, [e.name for e in events]
    launches = [e for e in events if e.name.startswith("kernelgen::conv2d[")]
    families = [spec_for(x, m[0].weight, m[0].bias, padding=1)[0].family,
                spec_for(m[1](m[0](x)), m[2].weight, m[2].bias, stride=(2, 1), groups=2)[0].family]
    assert [e.name for e in launches] == [f"kernelgen::conv2d[{f}]" for f in families], [e.name for e in events]
    assert all(e.cpu_parent is not None and e.cpu_parent.name == "kernelgen::conv2d" for e in launches)
    assert torch.equal(y, eager)


def test_profiled_call_keeps_autograd_and_errors():
    x, w = torch.randn(1, 4, 8, 8), torch.randn(6, 4, 3, 3, requires_grad=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        y = kernelgen.conv2d(x, w, padding=1)
        with pytest.raises(RuntimeError, match="groups"):
            kernelgen.conv2d(x, w, groups=3)
    assert y.requires_grad and torch.allclose(y, F.conv2d(x, w, padding=1), rtol=1e-5, atol=1e-5)
    y.sum().backward()
    assert w.grad is not None


def test_jit_trace_records_the_operator(tmp_path):
    m = _model()
    x = torch.randn(2, 4, 16, 16)
    with torch.no_grad():
        traced = torch.jit.trace(m, (x,))
        assert str(traced.inlined_graph).count("kernelgen::conv2d") == 2
        torch.jit.save(traced, tmp_path / "m.pt")
        loaded = torch.jit.load(tmp_path / "m.pt")
        x2 = torch.randn(3, 4, 12, 10)
        assert torch.equal(traced(x), m(x))
        assert torch.equal(loaded(x2), m(x2))


def test_jit_trace_records_the_fused_epilogue(tmp_path):
    # A call with an epilogue is one kernelgen::conv2d_epilogue node (and no kernelgen::conv2d),
    # which runs, saves and loads like conv2d's; the residual is the node's last input.
    torch.manual_seed(0)
    w, b = torch.randn(4, 4, 3, 3), torch.randn(4)

    def fused(x):
        return kernelgen.conv2d(x, w, b, padding=1, activation="leaky_relu", negative_slope=0.2, residual=x)

    x = torch.randn(2, 4, 8, 8)
    with torch.no_grad():
        traced = torch.jit.trace(fused, (x,))
        graph = str(traced.inlined_graph)
        assert graph.count("kernelgen::conv2d_epilogue") == 1 and "kernelgen::conv2d(" not in graph, graph
        torch.jit.save(traced, str(tmp_path / "f.pt"))  # (a ScriptFunction takes str only)
        loaded = torch.jit.load(str(tmp_path / "f.pt"))
        x2 = torch.randn(3, 4, 6, 10)
        ref = F.leaky_relu(F.conv2d(x2, w, b, padding=1) + x2, 0.2)
        assert torch.equal(traced(x), fused(x)) and close(loaded(x2), ref)


def test_jit_script_names_the_ways_that_work():
    with pytest.raises(RuntimeError, match="torch.jit.script cannot compile kernelgen.Conv2d") as info:
        torch.jit.script(_model())
    assert "kernelgen.revert" in str(info.value) and "torch.jit.trace" in str(info.value)


# ONNX export without onnx installed (CI's case; tests/test_onnx.py exports and runs the models where
# onnx and onnxruntime are). Each exporter captures the model while torch.onnx.is_in_onnx_export() is
# true, and kernelgen.conv2d is then F.conv2d: patching that public function shows what each captures.
@pytest.fixture
def onnx_exporting(monkeypatch):
    monkeypatch.setattr(torch.onnx, "is_in_onnx_export", lambda: True)
    yield
    torch._dynamo.reset()  # (Dynamo took kernelgen's check of it as a constant)


@pytest.mark.parametrize("shape", [(2, 4, 16, 16), (4, 16, 16)], ids=["batched", "unbatched"])
def test_torchscript_exporter_captures_aten_convolution(onnx_exporting, shape):
    m = _model()
    x = torch.randn(*shape)
    with torch.no_grad():
        graph = str(torch.jit.trace(m, (x,)).inlined_graph)  # as the TorchScript exporter captures
    assert graph.count("aten::_convolution") == 2 and "kernelgen::" not in graph, graph


@pytest.mark.parametrize("strict", [False, True])
def test_dynamo_exporter_captures_aten_conv2d(onnx_exporting, strict):
    m = _model()
    x = torch.randn(2, 4, 16, 16)
    ep = torch.export.export(m, (x,), strict=strict)  # as the dynamo exporter captures
    targets = [str(n.target) for n in ep.graph.nodes if n.op == "call_function"]
    assert sum("aten.conv2d" in t for t in targets) == 2 and not any("kernelgen" in t for t in targets), targets


def test_exported_program_decomposes_to_aten():
    # what the dynamo exporter (or anything that does not import kernelgen) is handed
    kg_onnx = import_module("kernelgen.onnx")
    m = _model()
    x = torch.randn(2, 4, 16, 16)
    ep = kg_onnx.decompose(torch.export.export(m, (x,)))
    targets = [str(n.target) for n in ep.graph.nodes if n.op == "call_function"]
    assert not any("kernelgen" in t for t in targets) and sum("aten.conv2d" in t for t in targets) == 2, targets
    with torch.no_grad():
        assert close(ep.module()(x), m(x))
