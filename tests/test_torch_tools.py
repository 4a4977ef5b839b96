"""Compile tier: PyTorch's tools around an eager call (FakeTensorMode, vmap, FlopCounterMode, the
profiler, TorchScript, ONNX export) see kernelgen.conv2d as they see F.conv2d; on the CPU family."""

from __future__ import annotations

import importlib.util
import io
import os
import subprocess
import sys
from importlib import import_module

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

import kernelgen

pytestmark = pytest.mark.compile

HAS_ONNX = importlib.util.find_spec("onnx") is not None
HAS_ONNXSCRIPT = importlib.util.find_spec("onnxscript") is not None
HAS_ORT = importlib.util.find_spec("onnxruntime") is not None
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


def test_profiler_shows_a_range_per_call():
    m = _model()
    x = torch.randn(2, 4, 16, 16)
    with torch.no_grad():
        eager = m(x)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            y = m(x)
    names = [e.name for e in prof.events()]
    assert names.count("kernelgen::conv2d") == 2, names
    assert torch.equal(y, eager)


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


def test_jit_script_names_the_ways_that_work():
    with pytest.raises(RuntimeError, match="torch.jit.script cannot compile kernelgen.Conv2d") as info:
        torch.jit.script(_model())
    assert "kernelgen.revert" in str(info.value) and "torch.jit.trace" in str(info.value)


# ONNX: the TorchScript-based exporter ends by handing its bytes to the onnx package; without it,
# that last step is skipped here (the ModelProto bytes are still written) and the graph is read
# from the exporter's verbose log.
@pytest.fixture
def torchscript_exporter(monkeypatch):
    if not HAS_ONNX:
        from torch.onnx._internal.torchscript_exporter import onnx_proto_utils

        monkeypatch.setattr(onnx_proto_utils, "_add_onnxscript_fn", lambda proto, opsets: proto)


def _check_onnx(data: bytes, m, x, convs: int):
    if not HAS_ONNX:
        assert data.count(b"Conv") >= convs and b"kernelgen::" not in data
        return
    import onnx

    proto = onnx.load_from_string(data)
    onnx.checker.check_model(proto)
    ops = [n.op_type for n in proto.graph.node]
    assert ops.count("Conv") == convs and all(n.domain in ("", "ai.onnx") for n in proto.graph.node), ops
    if HAS_ORT:
        import onnxruntime

        session = onnxruntime.InferenceSession(data, providers=["CPUExecutionProvider"])
        (y,) = session.run(None, {session.get_inputs()[0].name: x.numpy()})
        with torch.no_grad():
            assert close(torch.from_numpy(y), m(x))


@pytest.mark.parametrize("shape", [(2, 4, 12, 12), (4, 12, 12)], ids=["batched", "unbatched"])
@pytest.mark.parametrize("traced", [False, True], ids=["module", "traced module"])
def test_torchscript_onnx_export_writes_conv(torchscript_exporter, capfd, traced, shape):
    m = torch.nn.Sequential(kernelgen.Conv2d(4, 6, 3, padding="same", dilation=2), torch.nn.ReLU(),
                            kernelgen.Conv2d(6, 6, 3, stride=2, groups=2)).eval()
    x = torch.randn(*shape)
    if traced:
        import_module("kernelgen.onnx")  # registers the symbolic for the traced operator

        with torch.no_grad():
            model = torch.jit.trace(m, (x,))
    else:
        model = m
    f = io.BytesIO()
    torch.onnx.export(model, (x,), f, dynamo=False, verbose=True)
    graph = "".join(capfd.readouterr())
    assert graph.count("onnx::Conv[") == 2 and "kernelgen::conv2d" not in graph, graph[-3000:]
    if traced:
        assert 'auto_pad="SAME_UPPER", dilations=[2, 2]' in graph and "group=2" in graph
    _check_onnx(f.getvalue(), m, x, 2)


@pytest.mark.skipif(not HAS_ONNXSCRIPT, reason="the dynamo exporter needs onnxscript")
@pytest.mark.parametrize("form", ["module", "decomposed program", "translation table"])
def test_dynamo_onnx_export_writes_conv(form, tmp_path):
    kg_onnx = import_module("kernelgen.onnx")
    m = _model()
    x = torch.randn(2, 4, 16, 16)
    kw = {}
    if form == "module":
        model = m
    else:
        model = torch.export.export(m, (x,))
        if form == "decomposed program":
            model = kg_onnx.decompose(model)
        else:
            kw["custom_translation_table"] = kg_onnx.translation_table()
    program = torch.onnx.export(model, (x,), dynamo=True, **kw)
    program.save(str(tmp_path / "m.onnx"))
    _check_onnx((tmp_path / "m.onnx").read_bytes(), m, x, 2)


@pytest.mark.parametrize("strict", [False, True])
def test_dynamo_exporter_captures_aten_conv2d(monkeypatch, strict):
    # What the dynamo exporter captures (with torch.export, under the flag its export() sets),
    # checked without onnxscript, which the rest of that exporter needs.
    from torch.onnx._internal.exporter import _flags

    m = _model()
    x = torch.randn(2, 4, 16, 16)
    monkeypatch.setattr(_flags, "_is_onnx_exporting", True)
    assert torch.onnx.is_in_onnx_export()
    try:
        ep = torch.export.export(m, (x,), strict=strict)
    finally:
        torch._dynamo.reset()  # (Dynamo took the flag as a constant)
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
