"""kernelgen convolutions in ONNX: each one a standard `Conv`.

Exporting a model needs nothing from here: while `torch.onnx.export` runs (either exporter),
kernelgen.conv2d is F.conv2d (compiled.route), which both exporters write as `Conv`. An ONNX file
never runs kernelgen's kernels, so nothing of kernelgen is needed to load it.

This module is for graphs captured earlier, which hold the operator `kernelgen::conv2d`:

    import kernelgen.onnx
    traced = torch.jit.trace(model, args)
    torch.onnx.export(traced, args, "m.onnx", dynamo=False)    # the symbolic registered on import

    ep = torch.export.export(model, args)
    torch.onnx.export(kernelgen.onnx.decompose(ep), args, "m.onnx")      # the dynamo exporter
    torch.onnx.export(ep, args, "m.onnx", custom_translation_table=kernelgen.onnx.translation_table())

It is not imported by `import kernelgen`: torch.onnx costs a process ~50 ms to import.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch.onnx import symbolic_helper

from . import compiled  # noqa: F401  (defines the operator this module translates)

# The symbolic serves this opset and every later one; Conv, Unsqueeze and Squeeze with the inputs
# and attributes used here are in opset 13 and every later one.
_OPSET = 13


def _aten(input, weight, bias, stride, padding, padding_mode, dilation, groups, precision=None, family=None,
          tiles=None):
    """The operator's call as F.conv2d (precision, family and tiles choose kernels, not results)."""
    return F.conv2d(input, weight, bias, stride, padding_mode or padding, dilation, groups)


def decompose(program: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
    """`program` with every kernelgen::conv2d as aten.conv2d, which torch.onnx.export (and any other
    consumer of an ExportedProgram that does not import kernelgen) knows."""
    return program.run_decompositions({torch.ops.kernelgen.conv2d.default: _aten})


def _attributes(stride, padding, padding_mode, dilation, groups) -> dict:
    """ONNX Conv's attributes for the operator's parameters. 'same' is SAME_UPPER: torch pads the
    odd one at the end, as SAME_UPPER does (stride 1, which 'same' requires)."""
    attrs = {"strides": list(stride), "dilations": list(dilation), "group": int(groups)}
    if padding_mode == "same":
        attrs["auto_pad"] = "SAME_UPPER"
    elif padding_mode == "valid":
        attrs["pads"] = [0, 0, 0, 0]
    else:
        attrs["pads"] = [padding[0], padding[1], padding[0], padding[1]]
    return attrs


def _symbolic(g, input, weight, bias, stride, padding, padding_mode, dilation, groups, precision, family, tiles):
    """The TorchScript exporter's translation of a traced kernelgen::conv2d node."""
    const = symbolic_helper._maybe_get_const
    attrs = _attributes(const(stride, "is"), const(padding, "is"),
                        None if symbolic_helper._is_none(padding_mode) else const(padding_mode, "s"),
                        const(dilation, "is"), const(groups, "i"))
    unbatched = symbolic_helper._get_tensor_rank(input) == 3
    if unbatched:  # ONNX Conv takes (N, C, H, W) only
        input = symbolic_helper._unsqueeze_helper(g, input, [0])
    inputs = (input, weight) if symbolic_helper._is_none(bias) else (input, weight, bias)
    kw = {k + ("_s" if k == "auto_pad" else "_i"): v for k, v in attrs.items()}
    y = g.op("Conv", *inputs, **kw)
    return symbolic_helper._squeeze_helper(g, y, [0]) if unbatched else y


def translation_table() -> dict[Callable, Callable]:
    """`custom_translation_table` for the dynamo exporter (torch.onnx.export(..., dynamo=True)) of a
    program that holds kernelgen::conv2d: each one an ONNX Conv. Needs onnxscript."""
    from onnxscript import opset18 as op

    def conv2d(input, weight, bias=None, stride=(1, 1), padding=(0, 0), padding_mode=None, dilation=(1, 1),
               groups=1, precision=None, family=None, tiles=None):
        attrs = _attributes(stride, padding, padding_mode, dilation, groups)
        unbatched = len(input.shape) == 3
        if unbatched:
            input = op.Unsqueeze(input, op.Constant(value_ints=[0]))
        y = op.Conv(input, weight, **attrs) if bias is None else op.Conv(input, weight, bias, **attrs)
        return op.Squeeze(y, op.Constant(value_ints=[0])) if unbatched else y

    return {torch.ops.kernelgen.conv2d.default: conv2d}


torch.onnx.register_custom_op_symbolic("kernelgen::conv2d", _symbolic, _OPSET)
