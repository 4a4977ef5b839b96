"""kernelgen.conv2d under torch.compile: one custom operator, so that a compiled graph keeps each call whole.

Dynamo cannot trace kernelgen.conv2d itself (plan lookups, cache files, a C++ launch), so it would
break the graph around every call. While torch.compile traces, conv2d hands its call to the
operator `kernelgen::conv2d` instead (functional.conv2d checks torch.compiler.is_compiling()). The
operator's fake implementation gives the output's shape, dtype and format from the same checks
conv2d runs, without choosing or building a kernel; its real implementation is conv2d itself, run
eagerly by the compiled graph, so the kernels, the cache and the current stream are those of an
eager call.

The operators are defined when kernelgen is imported (about 5 ms): Dynamo must find them defined,
not trace their definitions. The call's arguments go in forms a schema can hold: stride, dilation
and padding as int lists (padding 'same' or 'valid' as `padding_mode`), tiles as JSON. conv2d has
no gradient formula of torch's, so the operator's backward is a second operator,
`kernelgen::conv2d_backward`, which computes the gradients as an eager backward does (gradients.py):
a compiled graph's backward holds one node for it. Through a fused activation its graph saves what
the eager Function saves: the call's output where the derivative reads it, else the bias and
residual from which the operator recomputes the pre-activation; a plain call saves input and weight.

A call with a fused epilogue (activation, residual) is the operator `kernelgen::conv2d_epilogue`,
whose schema is conv2d's and the epilogue's arguments (activation, negative_slope, residual, and
scale last with a default, so a graph without one holds the node it held before), with the same implementations: a graph
of plain calls holds `kernelgen::conv2d` with the schema it had before epilogues (a TorchScript
node holds every input of its schema, so a longer one would change every traced graph).

Eager calls that PyTorch's tools wrap or watch (FakeTensorMode, vmap, FlopCounterMode, the profiler,
the TorchScript tracer, ONNX export) take the same operators (`route`), so each tool sees one op.
"""

from __future__ import annotations

import json
import numbers
import operator
import sys
import threading
from typing import Mapping, Optional

import torch
from torch.utils.flop_counter import conv_flop_count, register_flop_formula

# Set while the operator's real implementation runs: the eager call inside it computes with kernels
# rather than routing back to the operator (see `route`).
_inside = threading.local()


@torch.library.custom_op("kernelgen::conv2d", mutates_args=())
def conv2d_op(input: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], stride: list[int],
              padding: list[int], padding_mode: Optional[str], dilation: list[int], groups: int,
              precision: Optional[str], family: Optional[str], tiles: Optional[str]) -> torch.Tensor:
    """The call, computed eagerly by kernelgen.conv2d (its output is always a new tensor)."""
    return _eager(input, weight, bias, stride, padding, padding_mode, dilation, groups, precision, family, tiles)


@torch.library.custom_op("kernelgen::conv2d_epilogue", mutates_args=())
def conv2d_epilogue_op(input: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], stride: list[int],
                       padding: list[int], padding_mode: Optional[str], dilation: list[int], groups: int,
                       precision: Optional[str], family: Optional[str], tiles: Optional[str],
                       activation: Optional[str], negative_slope: float,
                       residual: Optional[torch.Tensor], scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """A call with a fused epilogue, computed eagerly by kernelgen.conv2d. (`scale` last, with a
    default: a graph captured without one holds the node it held before scales.)"""
    return _eager(input, weight, bias, stride, padding, padding_mode, dilation, groups, precision, family, tiles,
                  activation, negative_slope, residual, scale)


def _eager(input, weight, bias, stride, padding, padding_mode, dilation, groups, precision, family, tiles,
           activation=None, negative_slope=0.01, residual=None, scale=None):
    from .functional import conv2d

    _inside.depth = getattr(_inside, "depth", 0) + 1
    try:
        return conv2d(input, weight, bias, stride, padding_mode or padding, dilation, groups, precision=precision,
                      family=family, tiles=None if tiles is None else json.loads(tiles), activation=activation,
                      negative_slope=negative_slope, residual=residual, scale=scale)
    finally:
        _inside.depth -= 1


@conv2d_op.register_fake
@conv2d_epilogue_op.register_fake
def _fake(input, weight, bias, stride, padding, padding_mode, dilation, groups, precision, family, tiles,
          activation=None, negative_slope=0.01, residual=None, scale=None):
    """The output conv2d would return, from conv2d's own checks; no kernel is chosen or built."""
    from . import checks
    from .spec import ConvSpec

    checks.check_tensors(input, weight, bias)
    groups = checks.check_shapes(input, weight, bias, groups)
    params = checks.spec_params(input, weight, bias, stride, padding_mode or padding, dilation, groups)
    call = checks.check_call(input, weight, ConvSpec(**params), input.device.type)
    checks.check_activation(activation)
    if activation == "leaky_relu":
        checks.slope_bits(negative_slope)
    checks.check_residual(residual, input, call)
    checks.check_scale(scale, input, call)
    shape = (call.K, call.P, call.Q) if call.unbatched else (call.N, call.K, call.P, call.Q)
    return torch.empty(shape, dtype=input.dtype, device=input.device,
                       memory_format=torch.channels_last if call.channels_last else torch.contiguous_format)


@torch.library.custom_op("kernelgen::conv2d_backward", mutates_args=())
def backward_op(grad: torch.Tensor, input: torch.Tensor, weight: torch.Tensor, output: Optional[torch.Tensor],
                bias: Optional[torch.Tensor], residual: Optional[torch.Tensor], stride: list[int], padding: list[int],
                padding_mode: Optional[str], dilation: list[int], groups: int, precision: Optional[str],
                family: Optional[str], tiles: Optional[str], activation: Optional[str], negative_slope: float,
                needs: list[bool], scale: Optional[torch.Tensor] = None) -> list[torch.Tensor]:
    """What a compiled graph's backward through conv2d runs: the gradients autograd `needs` (input,
    weight, bias, residual), each by kernelgen's forward kernels (gradients.backward); one not
    needed is an empty tensor. Through an activation: from the call's `output` where
    gradients.from_output says so, else from the pre-activation recomputed from input, weight,
    `bias` and `residual` (each None where not saved); `scale`: the epilogue's, if any. (An operator,
    so that the backward graph holds one node.)"""
    from .gradients import backward

    grads = backward(grad, input, weight, needs, stride, padding_mode or padding, dilation, groups, precision,
                     activation, negative_slope, output=output, bias=bias, residual=residual, family=family,
                     tiles=None if tiles is None else json.loads(tiles), scale=scale)
    return [g if g is not None else grad.new_empty(0) for g in grads]


@backward_op.register_fake
def _fake_backward(grad, input, weight, output, bias, residual, stride, padding, padding_mode, dilation, groups,
                   precision, family, tiles, activation, negative_slope, needs, scale=None):
    likes = (input, weight, weight.new_empty(weight.shape[0]), grad)
    return [torch.empty_like(t) if n else grad.new_empty(0) for t, n in zip(likes, needs)]


def _setup_context(ctx, inputs, output):
    # What gradients.to_save says, as the eager Function keeps it.
    from .gradients import to_save

    ctx.params = inputs[3:11]  # stride, padding, padding_mode, dilation, groups, precision, family, tiles
    ctx.has_bias = inputs[2] is not None
    ctx.activation, ctx.negative_slope = (inputs[11], inputs[12]) if len(inputs) > 11 else (None, 0.01)
    ctx.has_residual = len(inputs) > 13 and inputs[13] is not None
    ctx.n_inputs = len(inputs)
    ctx.save_for_backward(*to_save(ctx.activation, ctx.negative_slope, inputs[0], inputs[1], output, inputs[2],
                                   inputs[13] if len(inputs) > 13 else None, inputs[14] if len(inputs) > 14 else None))


def _backward(ctx, grad):
    input, weight, *epilogue = ctx.saved_tensors
    output, bias, residual, scale = epilogue or (None, None, None, None)
    n = ctx.needs_input_grad
    if len(n) > 14 and n[14]:
        from .gradients import SCALE_HAS_NO_GRADIENT

        raise NotImplementedError(SCALE_HAS_NO_GRADIENT)
    needs = [bool(n[0]), bool(n[1]), ctx.has_bias and bool(n[2]), ctx.has_residual and bool(n[13])]
    grads = backward_op(grad, input, weight, output, bias, residual, *ctx.params, ctx.activation,
                        ctx.negative_slope, needs, scale)
    gi, gw, gb, gr = (g if need else None for g, need in zip(grads, needs))
    out = [gi, gw, gb] + [None] * (ctx.n_inputs - 3)
    if ctx.n_inputs > 13:
        out[13] = gr
    return tuple(out)


conv2d_op.register_autograd(_backward, setup_context=_setup_context)
conv2d_epilogue_op.register_autograd(_backward, setup_context=_setup_context)


def _int(name: str, value) -> int:
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got {value!r}")
    return operator.index(value)


def _ints(name: str, value) -> list[int]:
    # (the schema's int lists; ConvSpec, in the fake implementation, checks lengths and signs with
    # F.conv2d's messages; here only what a schema cannot hold fails)
    return [_int(name, v) for v in (value if isinstance(value, (list, tuple)) else (value, value))]


def call(input, weight, bias, stride, padding, dilation, groups, precision: str | None, family: str | None,
         tiles: Mapping[str, int] | None, activation: str | None = None, negative_slope: float = 0.01,
         residual: torch.Tensor | None = None, scale: torch.Tensor | None = None) -> torch.Tensor:
    """conv2d's call through the operator, its arguments in the schema's forms (int lists; padding
    'same' or 'valid' as padding_mode; tiles as JSON). Traced by Dynamo: no imports here.

    Under ONNX export the call is F.conv2d instead, then the epilogue as torch's own operators: its
    semantics, which both exporters write as a standard `Conv` (and the activation's and `Add`'s
    nodes; an ONNX file never runs kernelgen's kernels). A scale is then a `Mul` between the Conv
    (without its bias) and an `Add` of the bias."""
    if _onnx_exporting():
        if scale is not None:
            y = epilogue(torch.nn.functional.conv2d(input, weight, None, stride, padding, dilation, groups), None,
                         scale=scale, bias=bias)
        else:
            y = torch.nn.functional.conv2d(input, weight, bias, stride, padding, dilation, groups)
        return epilogue(y, activation, negative_slope, residual)
    mode = padding if isinstance(padding, str) else None
    args = (input, weight, bias, _ints("stride", stride), [0, 0] if mode else _ints("padding", padding), mode,
            _ints("dilation", dilation), _int("groups", groups), precision, family,
            None if tiles is None else json.dumps(dict(tiles), sort_keys=True))
    if activation is None and residual is None and scale is None:
        return conv2d_op(*args)
    if scale is None:  # (the node a graph without a scale held before scales)
        return conv2d_epilogue_op(*args, activation, _slope(activation, negative_slope), residual)
    return conv2d_epilogue_op(*args, activation, _slope(activation, negative_slope), residual, scale)


def _slope(activation, value) -> float:
    """negative_slope in the schema's form, a float: leaky_relu's (the operator's checks explain one
    that is not finite), or a placeholder for the other activations, which ignore it."""
    if activation != "leaky_relu":
        return 0.01
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        from .checks import slope_bits  # (a warm start imports no validation module)

        slope_bits(value)  # raises ConvArgumentError, naming the value
    return float(value)


_F = torch.nn.functional
# kernelgen.ACTIVATIONS as torch computes them, (y, negative_slope) -> tensor: the fused epilogue's
# semantics, wherever torch's own operators compute it (ONNX export, decompositions, conversion).
TORCH_ACTIVATIONS = {
    "relu": lambda y, slope: _F.relu(y), "relu6": lambda y, slope: _F.relu6(y),
    "leaky_relu": lambda y, slope: _F.leaky_relu(y, slope), "silu": lambda y, slope: _F.silu(y),
    "gelu": lambda y, slope: _F.gelu(y), "hardswish": lambda y, slope: _F.hardswish(y),
    "hardsigmoid": lambda y, slope: _F.hardsigmoid(y), "sigmoid": lambda y, slope: torch.sigmoid(y),
}


def epilogue(y: torch.Tensor, activation: str | None, negative_slope: float = 0.01,
             residual: torch.Tensor | None = None, scale: torch.Tensor | None = None,
             bias: torch.Tensor | None = None) -> torch.Tensor:
    """activation(y + residual) by torch's own operators: the fused epilogue's semantics, as
    torch.onnx.export records it. With a `scale` (float32, per output channel), y is the convolution
    without its bias, and the result activation(y * scale[k] + bias[k] + residual), computed in
    float32 (float64 for float64) and rounded once to y's dtype."""
    if scale is not None:  # in the accumulator's type throughout, rounded once at the end, as the kernels
        dtype, shape = y.dtype, (-1, 1, 1)
        wide = torch.float64 if dtype == torch.float64 else torch.float32
        y = y.to(wide) * scale.to(wide).reshape(shape)
        if bias is not None:
            y = y + bias.to(wide).reshape(shape)
        return epilogue(y, activation, negative_slope, None if residual is None else residual.to(wide)).to(dtype)
    if residual is not None:
        y = y + residual
    if activation is None:
        return y
    if activation not in TORCH_ACTIVATIONS:
        from .checks import check_activation

        check_activation(activation)
    return TORCH_ACTIVATIONS[activation](y, negative_slope)


def route(input, weight, bias, stride, padding, dilation, groups, precision: str | None, family: str | None,
          tiles: Mapping[str, int] | None, activation: str | None = None, negative_slope: float = 0.01,
          residual: torch.Tensor | None = None, scale: torch.Tensor | None = None) -> torch.Tensor | None:
    """An eager call that something wraps or watches, through the operator; None where the eager
    path should run it.

    functional.conv2d asks this only when something is watching or wrapping the call: a fake,
    functional or other subclass tensor, a dispatch mode (FakeTensorMode, FlopCounterMode), a
    functorch transform (vmap), the TorchScript tracer or the profiler. Each of them sees the
    operator as it sees an aten op: the fake implementation gives FakeTensors their output, the
    vmap rule below folds the vmapped dimension into the batch, the flop formula counts it, the
    tracer records one node, the profiler one `kernelgen::conv2d` range (holding the launch's range,
    named for its family: `kernelgen::conv2d[cpu_direct]`). Inside the operator (`_inside`), and for
    arguments that are not tensors, the eager path runs and explains.
    """
    if getattr(_inside, "depth", 0) or not (isinstance(input, torch.Tensor) and isinstance(weight, torch.Tensor)
                                            and (bias is None or isinstance(bias, torch.Tensor))
                                            and (residual is None or isinstance(residual, torch.Tensor))
                                            and (scale is None or isinstance(scale, torch.Tensor))):
        return None
    return call(input, weight, bias, stride, padding, dilation, groups, precision, family, tiles, activation,
                negative_slope, residual, scale)


def _onnx_exporting() -> bool:
    """Whether torch.onnx.export (either exporter) is capturing the model. A constant of the whole
    capture to Dynamo (the dynamo exporter captures with torch.export). torch.onnx not imported
    means no export, and importing it would cost a process ~50 ms."""
    onnx = sys.modules.get("torch.onnx")
    return onnx is not None and onnx.is_in_onnx_export()


# What torch.compiler.assume_constant_result does, without its `import torch._dynamo`, which costs
# an `import kernelgen` a second (tests/test_compiled.py checks the mark is still Dynamo's).
_onnx_exporting._dynamo_marked_constant = True


def _vmap(info, in_dims, input, weight, bias, *params):
    """torch.vmap over a call: a vmapped input (weight and bias shared) is one call whose batch is
    the vmapped dimension times the input's own (or, for unbatched samples, the vmapped dimension),
    its residual (if any) folded the same way (a shared one repeated); a vmapped weight or bias, or
    a vmapped residual with a shared input, is one call per sample, stacked (correct; as slow as a
    loop)."""
    x_dim, w_dim, b_dim = in_dims[:3]
    epilogue = len(params) > 8  # (conv2d_epilogue_op: activation, negative_slope, residual, scale follow)
    params, residual, scale = params[:10], params[10] if epilogue else None, params[11] if len(params) > 11 else None
    r_dim = in_dims[13] if epilogue else None
    s_dim = in_dims[14] if len(in_dims) > 14 else None

    def op(x, w, b, r, s=scale):
        if not epilogue:
            return conv2d_op(x, w, b, *params)
        return conv2d_epilogue_op(x, w, b, *params, r) if s is None else conv2d_epilogue_op(x, w, b, *params, r, s)

    if w_dim is None and b_dim is None and s_dim is None and x_dim is not None:
        x = input.movedim(x_dim, 0)
        r = None
        if residual is not None:  # (vmapped, *the output's shape of one sample)
            r = residual.movedim(r_dim, 0) if r_dim is not None else residual.expand(x.shape[0], *residual.shape)
        if x.dim() == 4:  # (vmapped, C, H, W): each sample an unbatched input
            return op(x, weight, bias, r), 0
        y = op(x.flatten(0, 1), weight, bias, None if r is None else r.flatten(0, 1))
        return y.unflatten(0, x.shape[:2]), 0

    def sample(t, dim, i):
        return t if t is None or dim is None else t.select(dim, i)

    ys = [op(sample(input, x_dim, i), sample(weight, w_dim, i), sample(bias, b_dim, i), sample(residual, r_dim, i),
             sample(scale, s_dim, i)) for i in range(info.batch_size)]
    return torch.stack(ys), 0


conv2d_op.register_vmap(_vmap)
conv2d_epilogue_op.register_vmap(_vmap)


@register_flop_formula([torch.ops.kernelgen.conv2d, torch.ops.kernelgen.conv2d_epilogue])
def _flops(x_shape, w_shape, *args, out_shape=None, **kwargs) -> int:
    """FlopCounterMode's count for a call: torch's own convolution formula (an unbatched call counts
    as a batch of one, as F.conv2d's aten.convolution sees it). Registered at import, since each
    FlopCounterMode copies the formulas it is created with."""
    if len(x_shape) == 3:
        x_shape, out_shape = (1, *x_shape), (1, *out_shape)
    return conv_flop_count(x_shape, w_shape, out_shape)
