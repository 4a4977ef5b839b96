"""Compile tier: kernelgen in captured graphs (torch.compile, torch.export, torch.fx), on the CPU family."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import kernelgen

pytestmark = pytest.mark.compile
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(kernelgen.Conv2d(4, 8, 3, padding=1), torch.nn.ReLU(),
                               kernelgen.Conv2d(8, 6, (3, 5), stride=(2, 1), padding="valid", groups=2))


def test_one_graph_without_breaks():
    # Dynamo cannot trace conv2d's launch: without the operator each call broke the graph.
    m = _model()
    x = torch.randn(2, 4, 16, 16)
    explained = torch._dynamo.explain(m)(x)
    assert explained.graph_count == 1 and explained.graph_break_count == 0, explained.break_reasons
    ops = {str(n.target) for g in explained.graphs for n in g.graph.nodes if n.op == "call_function"}
    assert any("kernelgen.conv2d" in op for op in ops), ops


@pytest.mark.parametrize("channels_last", [False, True])
def test_inductor_matches_eager(channels_last):
    m = _model()
    x = torch.randn(2, 4, 16, 16)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    with torch.no_grad():
        eager = m(x)
        y = torch.compile(m, fullgraph=True)(x)
    assert torch.equal(y, eager)  # the same kernels, run by the graph
    assert y.is_contiguous(memory_format=torch.channels_last) == eager.is_contiguous(memory_format=torch.channels_last)


@pytest.mark.parametrize("strict", [False, True])
def test_export_holds_the_operator(strict):
    m = _model().eval()
    x = torch.randn(2, 4, 16, 16)
    ep = torch.export.export(m, (x,), strict=strict)
    targets = [str(n.target) for n in ep.graph.nodes if n.op == "call_function"]
    assert targets.count("kernelgen.conv2d.default") == 2, targets
    with torch.no_grad():
        assert torch.equal(ep.module()(x), m(x))


# A saved program loaded by a process of its own: with `import kernelgen`, without it, and decomposed
# to aten (kernelgen.onnx.decompose), which needs no kernelgen to load.
LOAD = r"""
import sys, torch
program, tensors, imports = sys.argv[1:]
if imports == "kernelgen":
    import kernelgen
x, eager = torch.load(tensors)
try:
    ep = torch.export.load(program)
except RuntimeError as e:
    print("load failed:", e)
    sys.exit(3)
targets = [str(n.target) for n in ep.graph.nodes if n.op == "call_function"]
with torch.no_grad():
    y = ep.module()(x)
ops = "kernelgen" if any("kernelgen" in t for t in targets) else "aten"
same = "equal" if torch.equal(y, eager) else "close" if torch.allclose(y, eager, rtol=1e-5, atol=1e-5) else "differ"
print(ops, same, "kernelgen" in sys.modules)
"""


@pytest.mark.parametrize("program, imports, expect", [
    ("kernelgen", "kernelgen", (0, "kernelgen equal True")),
    ("kernelgen", "nothing", (3, None)),
    ("decomposed", "nothing", (0, "aten close False"))])
def test_saved_program_loads_where_kernelgen_is_imported(program, imports, expect, tmp_path):
    m = _model().eval()
    x = torch.randn(2, 4, 16, 16)
    ep = torch.export.export(m, (x,))
    if program == "decomposed":
        from kernelgen.onnx import decompose

        ep = decompose(ep)
    torch.export.save(ep, tmp_path / "m.pt2")
    with torch.no_grad():
        torch.save((x, m(x)), tmp_path / "x.pt")
    p = subprocess.run([sys.executable, "-c", LOAD, str(tmp_path / "m.pt2"), str(tmp_path / "x.pt"), imports],
                       capture_output=True, text=True, timeout=300, env=dict(os.environ, PYTHONPATH=ROOT))
    rc, out = expect
    assert p.returncode == rc, (p.returncode, p.stdout, p.stderr[-3000:])
    if out is not None:
        assert p.stdout.strip() == out, (p.stdout, p.stderr[-3000:])
    else:  # torch's deserialisation error, its log naming the operator it cannot find
        assert "kernelgen.conv2d" in p.stderr, p.stderr[-3000:]


def test_fx_symbolic_trace_keeps_each_call_whole():
    # kernelgen.nn wraps its conv2d for torch.fx: a call is one node, not a trace into checks
    # that cannot take proxies (symbolic_trace failed on any model of kernelgen.Conv2d)
    m = torch.nn.Sequential(kernelgen.Conv2d(4, 8, 3, padding=1), torch.nn.ReLU(),
                            kernelgen.Conv2d(8, 8, 3, padding="same", padding_mode="reflect"))
    g = torch.fx.symbolic_trace(m)
    calls = [n for n in g.graph.nodes if n.op == "call_function" and n.target is kernelgen.conv2d]
    assert len(calls) == 2
    x = torch.randn(2, 4, 9, 9)
    with torch.no_grad():
        assert torch.equal(g(x), m(x))


def test_autocast_inside_the_graph():
    m = _model()
    x = torch.randn(2, 4, 16, 16)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        eager = m(x)
        y = torch.compile(m, backend="aot_eager", fullgraph=True)(x)
    assert y.dtype == eager.dtype == torch.bfloat16
    assert torch.equal(y, eager)


def test_functional_forms_and_dynamic_shapes():
    w = torch.randn(6, 2, 3, 3)
    b = torch.randn(6)

    def f(x):
        return kernelgen.conv2d(x, w, b, stride=1, padding="same", dilation=(2, 1), groups=2)

    g = torch.compile(f, backend="aot_eager", dynamic=True, fullgraph=True)
    for shape in ((1, 4, 9, 11), (3, 4, 12, 7)):
        x = torch.randn(*shape)
        ref = F.conv2d(x.double(), w.double(), b.double(), padding="same", dilation=(2, 1), groups=2)
        y = g(x)
        assert y.shape == ref.shape
        assert ((y.double() - ref).norm() / ref.norm()).item() <= 1e-5


@pytest.mark.parametrize("kw,message", [(dict(stride=0), "non-positive stride"), (dict(groups=(2,)), None),
                                        (dict(padding=(1, 1, 1, 1)), "list of 2 values")])
def test_bad_arguments_fail_while_tracing(kw, message):
    w = torch.randn(6, 4, 3, 3)
    g = torch.compile(lambda x: kernelgen.conv2d(x, w, **kw), backend="aot_eager", fullgraph=True)
    with pytest.raises(Exception, match=message):
        g(torch.randn(1, 4, 8, 8))


@pytest.mark.parametrize("bias", [True, False])
def test_a_compiled_graphs_backward_runs_kernelgens_gradients(bias):
    # parameters that require grad: the graph compiles with its backward, which computes the
    # gradients as eager does (kernelgen::conv2d_backward; tests/test_autograd.py checks the values)
    m = torch.nn.Sequential(kernelgen.Conv2d(4, 8, 3, padding=1, bias=bias), torch.nn.ReLU())
    y = torch.compile(m, backend="aot_eager", fullgraph=True)(torch.randn(2, 4, 16, 16))
    assert y.requires_grad
    y.sum().backward()
    assert m[0].weight.grad is not None and (m[0].bias is None or m[0].bias.grad is not None)


def test_import_kernelgen_leaves_dynamo_unimported():
    # torch._dynamo costs an import a second; kernelgen marks its one constant without it
    code = ("import sys, torch, kernelgen, kernelgen.functional, kernelgen.compiled\n"
            "assert 'torch._dynamo' not in sys.modules, 'import kernelgen imported torch._dynamo'\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))))
    assert r.returncode == 0, r.stderr[-2000:]


def test_the_onnx_constant_carries_dynamos_own_mark():
    # (what torch.compiler.assume_constant_result sets, read from Dynamo itself)
    from torch._dynamo.decorators import assume_constant_result

    from kernelgen import compiled

    def probe():
        return False

    marks = set(vars(assume_constant_result(probe)))
    assert marks and all(getattr(compiled._onnx_exporting, m, None) == getattr(probe, m) for m in marks)
