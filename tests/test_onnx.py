"""Compile tier, where onnx and onnxruntime are installed: a model with kernelgen convolutions (fused
epilogues included), exported by either torch.onnx exporter, is a standard ONNX model (`Conv` nodes,
onnx.checker) that onnxruntime runs to the torch model's outputs. Skipped without them (the `test`
extra installs them; the dynamo exporter's tests also need onnxscript, which it does not);
tests/test_torch_tools.py checks what the exporters capture without them."""

from __future__ import annotations

import copy
from importlib import import_module

import pytest
import torch

import kernelgen

onnx = pytest.importorskip("onnx")
onnxruntime = pytest.importorskip("onnxruntime")

pytestmark = [pytest.mark.compile, pytest.mark.filterwarnings("ignore::DeprecationWarning"),
              pytest.mark.filterwarnings("ignore::FutureWarning")]


def _layers():
    """kernelgen.Conv2d layers: padding, a rectangular kernel, stride, groups, 'valid'."""
    torch.manual_seed(0)
    return torch.nn.Sequential(kernelgen.Conv2d(4, 8, 3, padding=1), torch.nn.ReLU(),
                               kernelgen.Conv2d(8, 6, (3, 5), stride=(2, 1), padding="valid", groups=2)).eval()


def _same_dilated():
    """'same' padding with a dilation (onnxruntime refuses auto_pad SAME_UPPER with a dilation)."""
    torch.manual_seed(0)
    return torch.nn.Sequential(kernelgen.Conv2d(4, 6, 3, padding="same", dilation=2), torch.nn.ReLU(),
                               kernelgen.Conv2d(6, 6, 3, stride=2, groups=2)).eval()


def _converted():
    """A torch model of Conv2d + BatchNorm2d, converted with its BatchNorms folded into the convolutions."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(4, 8, 3, padding=1, bias=False), torch.nn.BatchNorm2d(8),
                                torch.nn.ReLU(), torch.nn.Conv2d(8, 6, 3, stride=2, groups=2)).eval()
    model[1].running_mean.uniform_(-1, 1)
    model[1].running_var.uniform_(0.5, 2)
    kernelgen.convert(model, example_inputs=(torch.randn(2, 4, 12, 12),), fold_bn=True)
    assert isinstance(model[0], kernelgen.Conv2d) and isinstance(model[1], torch.nn.Identity)
    return model


MODELS = {"layers": _layers, "converted": _converted, "same dilated": _same_dilated}


def _export(model, x, exporter: str, path, **kw) -> bytes:
    """The ONNX file `exporter` ('dynamo' or 'torchscript') writes for model(x)."""
    if exporter == "dynamo":
        pytest.importorskip("onnxscript")  # the dynamo exporter's translator
        torch.onnx.export(model, (x,), dynamo=True, verbose=False, **kw).save(str(path))
    else:
        torch.onnx.export(model, (x,), str(path), dynamo=False, **kw)
    return path.read_bytes()


def _translation_table() -> dict:
    """kernelgen.onnx.translation_table(), which imports onnxscript: skipped without it, as _export is."""
    pytest.importorskip("onnxscript")
    return import_module("kernelgen.onnx").translation_table()


def _export_captured(model, x: torch.Tensor, form: str, tmp_path) -> bytes:
    """The ONNX file of `model` captured first, then exported: as a traced module (TorchScript), an
    ExportedProgram decomposed by kernelgen.onnx.decompose, or one translated by its table (importing
    kernelgen.onnx registers the TorchScript exporter's symbolics)."""
    kg_onnx = import_module("kernelgen.onnx")
    with torch.no_grad():
        if form == "traced module":
            return _export(torch.jit.trace(model, (x,)), x, "torchscript", tmp_path / "m.onnx")
        program = torch.export.export(model, (x,))
        if form == "decomposed program":
            return _export(kg_onnx.decompose(program), x, "dynamo", tmp_path / "m.onnx")
        return _export(program, x, "dynamo", tmp_path / "m.onnx", custom_translation_table=_translation_table())


def _convs(data: bytes) -> list[tuple]:
    """Each node of a checked standard ONNX model: its op and attributes (Conv, Relu, ...)."""
    proto = onnx.load_from_string(data)
    onnx.checker.check_model(proto, full_check=True)
    assert all(n.domain in ("", "ai.onnx") for n in proto.graph.node), [(n.op_type, n.domain) for n in proto.graph.node]
    return [(n.op_type, sorted((a.name, str(onnx.helper.get_attribute_value(a))) for a in n.attribute))
            for n in proto.graph.node]


def _run(data: bytes, x: torch.Tensor) -> torch.Tensor:
    session = onnxruntime.InferenceSession(data, providers=["CPUExecutionProvider"])
    (y,) = session.run(None, {session.get_inputs()[0].name: x.numpy()})
    return torch.from_numpy(y)


def _check_runs(data: bytes, model, x: torch.Tensor, convs: int) -> None:
    """`convs` Conv nodes, a valid model, and onnxruntime's outputs those of the torch model."""
    ops = [op for op, _ in _convs(data)]
    assert ops.count("Conv") == convs and "BatchNormalization" not in ops, ops
    with torch.no_grad():
        torch.testing.assert_close(_run(data, x), model(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("exporter", ["dynamo", "torchscript"])
@pytest.mark.parametrize("name, shape", [("layers", (2, 4, 12, 12)), ("layers", (4, 12, 12)),
                                         ("converted", (2, 4, 12, 12))], ids=["batched", "unbatched", "converted"])
def test_export_runs_in_onnxruntime(exporter, name, shape, tmp_path):
    model = MODELS[name]()
    x = torch.randn(*shape)
    _check_runs(_export(model, x, exporter, tmp_path / "m.onnx"), model, x, 2)


@pytest.mark.parametrize("exporter", ["dynamo", "torchscript"])
@pytest.mark.parametrize("name", list(MODELS))
def test_export_is_nn_conv2ds(exporter, name, tmp_path):
    # The same nodes and attributes as the model on torch's layers: a kernelgen convolution exports
    # as torch's own does (with torch's one quirk: the TorchScript exporter writes 'same' with a
    # dilation as auto_pad SAME_UPPER, which onnxruntime refuses for nn.Conv2d too).
    model = MODELS[name]()
    torch_model = kernelgen.revert(copy.deepcopy(model))
    assert not any(isinstance(m, kernelgen.Conv2d) for m in torch_model.modules())
    x = torch.randn(2, 4, 12, 12)
    ours = _convs(_export(model, x, exporter, tmp_path / "kg.onnx"))
    assert ours == _convs(_export(torch_model, x, exporter, tmp_path / "torch.onnx"))


@pytest.mark.parametrize("form", ["traced module", "decomposed program", "translation table"])
@pytest.mark.parametrize("name, shape", [("layers", (2, 4, 12, 12)), ("layers", (4, 12, 12)),
                                         ("same dilated", (2, 4, 12, 12))],
                         ids=["batched", "unbatched", "same dilated"])
def test_captured_operator_exports_as_conv(form, name, shape, tmp_path):
    # Graphs captured before the export (holding kernelgen::conv2d), translated by kernelgen.onnx.
    model = MODELS[name]()
    x = torch.randn(*shape)
    _check_runs(_export_captured(model, x, form, tmp_path), model, x, 2)


class _Fused(torch.nn.Module):
    """Calls with fused epilogues: every activation, one with a residual (kernelgen::conv2d_epilogue)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.w = torch.nn.Parameter(torch.randn(4, 4, 3, 3) * 0.3)
        self.b = torch.nn.Parameter(torch.randn(4))

    def forward(self, x):
        for act in kernelgen.ACTIVATIONS:
            x = kernelgen.conv2d(x, self.w, self.b, padding=1, activation=act, negative_slope=0.2,
                                 residual=x if act == "relu" else None)
        return x


@pytest.mark.parametrize("form", ["traced module", "decomposed program", "translation table"])
def test_captured_epilogues_export_as_conv_add_and_activations(form, tmp_path):
    kg_onnx = import_module("kernelgen.onnx")
    model = _Fused().eval()
    x = torch.randn(2, 4, 10, 10)
    with torch.no_grad():
        if form == "traced module":
            traced = torch.jit.trace(model, (x,))
            assert str(traced.inlined_graph).count("kernelgen::conv2d_epilogue") == len(kernelgen.ACTIVATIONS)
            data = _export(traced, x, "torchscript", tmp_path / "m.onnx")
            _check_runs(data, model, x, len(kernelgen.ACTIVATIONS))
            return
        program = torch.export.export(model, (x,))
        ops = {str(n.target) for n in program.graph.nodes if n.op == "call_function"}
        assert "kernelgen.conv2d_epilogue.default" in ops
        if form == "decomposed program":
            data = _export(kg_onnx.decompose(program), x, "dynamo", tmp_path / "m.onnx")
        else:
            data = _export(program, x, "dynamo", tmp_path / "m.onnx", custom_translation_table=_translation_table())
    nodes = [n.op_type for n in onnx.load_from_string(data).graph.node]
    assert nodes.count("Conv") == len(kernelgen.ACTIVATIONS) and "Add" in nodes
    _check_runs(data, model, x, len(kernelgen.ACTIVATIONS))


class _Epilogue(torch.nn.Module):
    """One kernelgen.conv2d call with a fused epilogue: `activation`, the input as residual or none,
    a bias or none."""

    def __init__(self, activation, residual, bias):
        super().__init__()
        torch.manual_seed(0)
        self.activation, self.residual = activation, residual
        self.w = torch.nn.Parameter(torch.randn(4, 4, 3, 3) * 0.3)
        self.b = torch.nn.Parameter(torch.randn(4)) if bias else None

    def forward(self, x):
        return kernelgen.conv2d(x, self.w, self.b, padding=1, activation=self.activation, negative_slope=0.2,
                                residual=x if self.residual else None)


# Every activation (and none: a residual alone), with and without residual and bias; opset 20, the
# TorchScript exporter's default, where GELU is one Gelu node.
EPILOGUES = [(a, r, b) for a in (None,) + kernelgen.ACTIVATIONS for r in (False, True) for b in (False, True)
             if a is not None or r]


@pytest.mark.parametrize("activation, residual, bias", EPILOGUES,
                         ids=[f"{a}{'-residual' if r else ''}{'-bias' if b else ''}" for a, r, b in EPILOGUES])
def test_traced_epilogue_exports_with_torchscript(activation, residual, bias, tmp_path):
    import_module("kernelgen.onnx")  # registers the symbolics
    model = _Epilogue(activation, residual, bias).eval()
    x = torch.randn(2, 4, 6, 6)
    with torch.no_grad():
        traced = torch.jit.trace(model, (x,))
        assert "kernelgen::conv2d_epilogue" in str(traced.inlined_graph)
        data = _export(traced, x, "torchscript", tmp_path / "m.onnx")
    ops = [op for op, _ in _convs(data)]
    assert ops.count("Add") == residual, ops
    _check_runs(data, model, x, 1)


ERF_GELU = ["Mul", "Mul", "Erf", "Add", "Mul"]  # x * 0.5 * (1 + erf(x / sqrt 2))


@pytest.mark.parametrize("opset, activation, nodes", [
    (13, "gelu", ERF_GELU), (13, "hardswish", ["HardSigmoid", "Mul"]), (18, "gelu", ERF_GELU),
    (18, "hardswish", ["HardSwish"]), (20, "gelu", ["Gelu"])])
def test_traced_epilogue_in_the_files_opset(opset, activation, nodes, tmp_path):
    # Gelu (opset 20) and HardSwish (14) where the file's opset has them, else their definitions.
    import_module("kernelgen.onnx")
    model = _Epilogue(activation, True, True).eval()
    x = torch.randn(4, 6, 6)  # unbatched: Unsqueeze, Conv, Squeeze, then the residual's Add
    with torch.no_grad():
        data = _export(torch.jit.trace(model, (x,)), x, "torchscript", tmp_path / "m.onnx", opset_version=opset)
    proto = onnx.load_from_string(data)
    assert proto.opset_import[0].version == opset
    ops = [op for op, _ in _convs(data) if op != "Constant"]
    assert ops == ["Unsqueeze", "Conv", "Squeeze", "Add", *nodes], ops
    _check_runs(data, model, x, 1)


class _Block(torch.nn.Module):
    """conv-bn-relu, then conv-bn, the block's input added and SiLU: `convert(fuse=True)` makes
    two calls with fused epilogues (one with the residual)."""

    def __init__(self):
        super().__init__()
        self.conv1, self.bn1 = torch.nn.Conv2d(6, 6, 3, padding=1, bias=False), torch.nn.BatchNorm2d(6)
        self.conv2, self.bn2 = torch.nn.Conv2d(6, 6, 3, padding=1, bias=False), torch.nn.BatchNorm2d(6)
        self.relu, self.silu = torch.nn.ReLU(inplace=True), torch.nn.SiLU()

    def forward(self, x):
        return self.silu(self.bn2(self.conv2(self.relu(self.bn1(self.conv1(x))))) + x)


@pytest.mark.parametrize("form, exporter", [("module", "dynamo"), ("module", "torchscript"),
                                           ("traced module", "torchscript")])
def test_fused_conversion_exports(form, exporter, tmp_path):
    torch.manual_seed(0)
    model = _Block().eval()
    for bn in (model.bn1, model.bn2):
        bn.running_mean.uniform_(-1, 1)
        bn.running_var.uniform_(0.5, 2)
    x = torch.randn(2, 6, 8, 8)
    kernelgen.convert(model, example_inputs=(x,), fold_bn=True, fuse=True)
    assert len([r for r in kernelgen.report(model).rows if r["fused"]]) == 2
    with torch.no_grad():
        if form == "traced module":
            import_module("kernelgen.onnx")
            traced = torch.jit.trace(model, (x,))
            assert str(traced.inlined_graph).count("kernelgen::conv2d_epilogue") == 2
            data = _export(traced, x, "torchscript", tmp_path / "m.onnx")
        else:
            data = _export(model, x, exporter, tmp_path / "m.onnx")
    ops = [op for op, _ in _convs(data)]
    assert ops.count("Add") == 1 and "Relu" in ops and "Sigmoid" in ops, ops
    _check_runs(data, model, x, 2)


class _Scaled(torch.nn.Module):
    """A folded BatchNorm's call: kernelgen.conv2d with a float32 scale, a bias and a relu."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.w = torch.nn.Parameter(torch.randn(4, 4, 3, 3) * 0.3)
        self.b = torch.nn.Parameter(torch.randn(4))
        self.register_buffer("s", torch.rand(4) + 0.5)

    def forward(self, x):
        return kernelgen.conv2d(x, self.w, self.b, padding=1, activation="relu", scale=self.s)


@pytest.mark.parametrize("form", ["traced module", "decomposed program", "translation table"])
def test_a_scaled_epilogue_exports_as_conv_mul_add(form, tmp_path):
    model = _Scaled().eval()
    x = torch.randn(2, 4, 10, 10)
    data = _export_captured(model, x, form, tmp_path)
    nodes = [n.op_type for n in onnx.load_from_string(data).graph.node]
    assert "Conv" in nodes and "Mul" in nodes and "Relu" in nodes
    _check_runs(data, model, x, 1)
