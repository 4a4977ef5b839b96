"""kernelgen convolutions in ONNX: each one a standard `Conv`.

Exporting a model needs nothing from here: while `torch.onnx.export` runs (either exporter),
kernelgen.conv2d is F.conv2d (compiled.route), which both exporters write as `Conv`. An ONNX file
never runs kernelgen's kernels, so nothing of kernelgen is needed to load it.

This module is for graphs captured earlier, which hold the operator `kernelgen::conv2d` (or, for a
call with a fused epilogue, `kernelgen::conv2d_epilogue`, exported as Conv, Add and the activation):

    import kernelgen.onnx
    traced = torch.jit.trace(model, args)
    torch.onnx.export(traced, args, "m.onnx", dynamo=False)    # the symbolic registered on import

    ep = torch.export.export(model, args)
    torch.onnx.export(kernelgen.onnx.decompose(ep), args, "m.onnx")      # the dynamo exporter
    torch.onnx.export(ep, args, "m.onnx", custom_translation_table=kernelgen.onnx.translation_table())

`decompose` also makes a saved torch.export program that loads without kernelgen (on torch's
convolution). Checked with onnx.checker and onnxruntime: docs/tools.md. It is not imported by
`import kernelgen`: torch.onnx costs a process ~50 ms to import.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch.onnx import symbolic_helper

from . import compiled  # (defines the operators this module translates)

# The symbolics serve this opset and every later one: Conv, Unsqueeze, Squeeze, Add and the
# activations' nodes with the inputs and attributes used here are in opset 13 and every later one
# (HardSwish and Gelu, added later, are written only where the file's opset has them: `_activate`).
_OPSET = 13


def _aten(input, weight, bias, stride, padding, padding_mode, dilation, groups, precision=None, family=None,
          tiles=None):
    """The operator's call as F.conv2d (precision, family and tiles choose kernels, not results)."""
    return F.conv2d(input, weight, bias, stride, padding_mode or padding, dilation, groups)


def _aten_epilogue(input, weight, bias, stride, padding, padding_mode, dilation, groups, precision, family, tiles,
                   activation, negative_slope, residual, scale=None):
    """kernelgen::conv2d_epilogue as F.conv2d, then the scale and bias (where there is a scale), the
    residual add and the activation."""
    y = _aten(input, weight, bias if scale is None else None, stride, padding, padding_mode, dilation, groups)
    return compiled.epilogue(y, activation, negative_slope, residual, scale, bias)  # (bias: read with a scale only)


def decompose(program: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
    """`program` with every kernelgen::conv2d as aten.conv2d (and each fused epilogue as torch's add
    and activation), which torch.onnx.export (and any other consumer of an ExportedProgram that
    does not import kernelgen) knows."""
    return program.run_decompositions({torch.ops.kernelgen.conv2d.default: _aten,
                                       torch.ops.kernelgen.conv2d_epilogue.default: _aten_epilogue})


def _attributes(stride, padding, padding_mode, dilation, groups, kernel_size) -> dict:
    """ONNX Conv's attributes for the operator's parameters. 'same' is written as explicit pads,
    the odd one at the end as torch pads it (stride 1, which 'same' requires): ONNX's auto_pad
    SAME_UPPER means the same, but onnxruntime refuses it with a dilation."""
    if padding_mode == "valid":
        pads = [0, 0, 0, 0]
    elif padding_mode == "same":
        total = [d * (k - 1) for d, k in zip(dilation, kernel_size)]
        pads = [total[0] // 2, total[1] // 2, total[0] - total[0] // 2, total[1] - total[1] // 2]
    else:
        pads = [padding[0], padding[1], padding[0], padding[1]]
    return {"strides": list(stride), "pads": pads, "dilations": list(dilation), "group": int(groups)}


@symbolic_helper.parse_args("v", "v", "v", "is", "is", "s", "is", "i", "none", "none", "none")
def _symbolic(g, input, weight, bias, stride, padding, padding_mode, dilation, groups, precision, family, tiles):
    """The TorchScript exporter's translation of a traced kernelgen::conv2d node (public API only:
    parse_args and the graph's own values)."""
    kernel_size = weight.type().varyingSizes()[2:]
    if padding_mode == "same" and None in kernel_size:
        raise ValueError("kernelgen.onnx: padding='same' needs the weight's kernel size, which the traced graph "
                         f"does not know ({weight.type()}); trace with the weight as a parameter of fixed shape")
    attrs = _attributes(stride, padding, padding_mode, dilation, groups, kernel_size)
    unbatched = input.type().dim() == 3
    axis = g.op("Constant", value_t=torch.tensor([0], dtype=torch.long))
    if unbatched:  # ONNX Conv takes (N, C, H, W) only
        input = g.op("Unsqueeze", input, axis)
    inputs = (input, weight) if bias is None or bias.node().mustBeNone() else (input, weight, bias)
    y = g.op("Conv", *inputs, **{k + "_i": v for k, v in attrs.items()})
    return g.op("Squeeze", y, axis) if unbatched else y


# (conv2d's arguments stay graph values here: `_symbolic` parses them)
@symbolic_helper.parse_args("v", "v", "v", "v", "v", "v", "v", "v", "none", "none", "none", "s", "f", "v", "v")
def _symbolic_epilogue(g, input, weight, bias, stride, padding, padding_mode, dilation, groups, precision, family,
                       tiles, activation, negative_slope, residual, scale=None):
    """The TorchScript exporter's translation of a traced kernelgen::conv2d_epilogue node: conv2d's
    Conv, then Mul by the scale and Add of the bias (where there is a scale; in the model's dtype),
    Add of the residual (if any) and the activation (`_activate`, in the file's opset)."""
    scaled = scale is not None and not scale.node().mustBeNone()
    y = _symbolic(g, input, weight, None if scaled else bias, stride, padding, padding_mode, dilation, groups,
                  precision, family, tiles)
    if scaled:
        y = _scale(_GraphOps(g), y, scale, None if bias.node().mustBeNone() else bias,
                   g.op("Constant", value_t=torch.tensor([-1, 1, 1], dtype=torch.long)))
    if not residual.node().mustBeNone():
        y = g.op("Add", y, residual)
    if activation is None:
        return y
    dtype = input.type().dtype()
    return _activate(_GraphOps(g), lambda v: g.op("Constant", value_t=torch.tensor(v, dtype=dtype)), y,
                     activation, negative_slope, g.opset)


def _scale(op, y, scale, bias, shape):
    """y * scale[k] (+ bias[k]) per channel, in y's dtype: `shape` is the constant (-1, 1, 1), which
    broadcasts over (N, C, H, W) and unbatched (C, H, W). `op` as in _activate."""
    y = op.Mul(y, op.Reshape(op.CastLike(scale, y), shape))
    return y if bias is None else op.Add(y, op.Reshape(bias, shape))


class _GraphOps:
    """A TorchScript graph's nodes in onnxscript's spelling, `op.Relu(y)`, `op.LeakyRelu(y,
    alpha=0.2)`, so that `_activate` serves both exporters (g.op wants each attribute's type as a
    suffix: alpha_f)."""

    _SUFFIX = {float: "_f", int: "_i", str: "_s"}

    def __init__(self, g):
        self._g = g

    def __getattr__(self, op_type: str) -> Callable:
        if op_type.startswith("_"):  # (copy, pickle and friends probing for hooks)
            raise AttributeError(op_type)
        return lambda *inputs, **attrs: self._g.op(op_type, *inputs,
                                                   **{k + self._SUFFIX[type(v)]: v for k, v in attrs.items()})


def _activate(op, const: Callable, y, activation: str, slope: float, opset: int):
    """`activation` (a member of kernelgen.ACTIVATIONS) of y as standard ONNX nodes that compute what
    torch does (compiled.TORCH_ACTIVATIONS). `op.Relu(y)` makes a node (onnxscript's opset, or
    _GraphOps), `const(0.5)` a scalar of y's dtype; `opset` is the file's: HardSwish came in 14 and
    Gelu in 20, earlier files get their definitions as nodes."""
    if activation == "relu":
        return op.Relu(y)
    if activation == "relu6":  # torch's: hardtanh(x, 0, 6)
        return op.Clip(y, const(0.0), const(6.0))
    if activation == "leaky_relu":
        return op.LeakyRelu(y, alpha=float(slope))
    if activation == "silu":
        return op.Mul(y, op.Sigmoid(y))
    if activation == "gelu":  # the exact (erf) form: x * (1 + erf(x / sqrt 2)) / 2
        if opset >= 20:
            return op.Gelu(y, approximate="none")
        return op.Mul(op.Mul(y, const(0.5)), op.Add(const(1.0), op.Erf(op.Mul(y, const(2.0 ** -0.5)))))
    if activation == "hardswish" and opset >= 14:
        return op.HardSwish(y)
    if activation in ("hardsigmoid", "hardswish"):  # torch's hardsigmoid: relu6(x + 3) / 6
        s = op.HardSigmoid(y, alpha=1.0 / 6.0, beta=0.5)
        return s if activation == "hardsigmoid" else op.Mul(y, s)
    if activation == "sigmoid":
        return op.Sigmoid(y)
    raise ValueError(f"kernelgen.onnx: activation {activation!r} has no ONNX translation; "
                     f"expected one of {list(compiled.TORCH_ACTIVATIONS)}")


def translation_table() -> dict[Callable, Callable]:
    """`custom_translation_table` for the dynamo exporter (torch.onnx.export(..., dynamo=True)) of a
    program that holds kernelgen::conv2d (each one an ONNX Conv) or kernelgen::conv2d_epilogue (Conv,
    Add, the activation). Needs onnxscript."""
    from onnxscript import opset18 as op

    def conv2d(input, weight, bias=None, stride=(1, 1), padding=(0, 0), padding_mode=None, dilation=(1, 1),
               groups=1, precision=None, family=None, tiles=None):
        attrs = _attributes(stride, padding, padding_mode, dilation, groups, weight.shape[2:])
        unbatched = len(input.shape) == 3
        if unbatched:
            input = op.Unsqueeze(input, op.Constant(value_ints=[0]))
        y = op.Conv(input, weight, **attrs) if bias is None else op.Conv(input, weight, bias, **attrs)
        return op.Squeeze(y, op.Constant(value_ints=[0])) if unbatched else y

    def const(y):
        return lambda v: op.CastLike(op.Constant(value_float=v), y)

    def conv2d_epilogue(input, weight, bias=None, stride=(1, 1), padding=(0, 0), padding_mode=None, dilation=(1, 1),
                        groups=1, precision=None, family=None, tiles=None, activation=None, negative_slope=0.01,
                        residual=None, scale=None):
        y = conv2d(input, weight, bias if scale is None else None, stride, padding, padding_mode, dilation, groups)
        if scale is not None:
            y = _scale(op, y, scale, bias, op.Constant(value_ints=[-1, 1, 1]))
        if residual is not None:
            y = op.Add(y, residual)
        return y if activation is None else _activate(op, const(y), y, activation, negative_slope, op.version)

    return {torch.ops.kernelgen.conv2d.default: conv2d, torch.ops.kernelgen.conv2d_epilogue.default: conv2d_epilogue}


torch.onnx.register_custom_op_symbolic("kernelgen::conv2d", _symbolic, _OPSET)
torch.onnx.register_custom_op_symbolic("kernelgen::conv2d_epilogue", _symbolic_epilogue, _OPSET)
