"""A whole model's convolutions on kernelgen: `convert`, `revert`, `report` (issue 53).

    model = kernelgen.convert(model, example_inputs=(x,))   # in place; returns the model
    print(kernelgen.report(model))                          # per layer: input, kernel, fused ops, µs vs F.conv2d
    kernelgen.revert(model)                                 # back to torch's convolution

A layer is converted by changing its class in place (`module.__class__`), not by building a new
module: the object stays the same, so its Parameters, buffers, hooks, training flag, device, dtype,
`state_dict` keys, and every reference to it (a parent, a layer shared by two parents, an
optimizer's parameter list) are untouched. Each converted layer carries `kernelgen_layer`, a
`Layer` record of what convert did to it; `revert` and `report` read it.

The module is `conversion`, not `convert`: importing a submodule sets it as an attribute of its
package, so a `kernelgen/convert.py` imported before `kernelgen.convert` was first looked up would
leave `kernelgen.convert` a module rather than the function.

`fuse=True` also stays in place: the model's (or, where it does not trace, each nn.Sequential's)
`forward` becomes an instance attribute, a `FusedForward` that runs the module's torch.fx trace with
each convolution and its following residual add and activation as one call; `revert` removes it.
The code reads every submodule through the module itself, so a submodule replaced later is used.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import itertools
import linecache
import logging
import operator
import types
import weakref
from collections import Counter
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from . import compiled
from .functional import conv2d
from .kernels import count
from .nn import BN_SCALE
from .nn import Conv2d as KgConv2d

log = logging.getLogger("kernelgen")

ATTR = "kernelgen_layer"
FALLBACKS = (None, "torch")


@dataclasses.dataclass
class Layer:
    """What `convert` did to one layer (the layer's `kernelgen_layer` attribute).

    original: the class `revert` restores. bn: the qualified name of the BatchNorm2d folded into
    the layer, or None. fallback: 'torch' where the layer was measured slower on kernelgen than
    F.conv2d and keeps torch's convolution (its class is `original` then), else None.
    input: a meta tensor with the shape, strides and dtype of the layer's input at the last
    recorded call (convert's or report's example inputs), or None. epilogue: that call's fused
    epilogue ("+residual, relu"), or None for a bare convolution. plan: the kernel kernelgen runs
    for that call, epilogue included (ConvSpec.summary()); tuned: whether it was measured on this
    device. us, torch_us: that call's time in microseconds, where measured: kernelgen.conv2d with
    the epilogue, against F.conv2d followed by torch's add and activation (what the fused call
    replaces, and what the layer computes after falling back).
    """

    original: type
    bn: str | None = None
    fallback: str | None = None
    input: torch.Tensor | None = None
    epilogue: str | None = None
    plan: str | None = None
    tuned: bool = False
    us: float | None = None
    torch_us: float | None = None
    added_precision: bool = False  # convert set `precision`, which revert then removes
    # fuse=True: what each fused call of the layer takes into its epilogue ("+residual, relu"), and
    # how many calls computed that add and activation in torch (a residual the kernel cannot take)
    fused: list[str] = dataclasses.field(default_factory=list)
    epilogue_in_torch: int = 0


def convert(model: nn.Module, example_inputs: Any = None, *, fold_bn: bool = False, fuse: bool = False,
            tune: bool = False, fallback: str | None = None) -> nn.Module:
    """Run every torch.nn.Conv2d of `model` on kernelgen, in place; returns `model`.

    Converted: torch.nn.Conv2d, and its subclasses whose forward is torch's or calls
    `self._conv_forward` (those keep their own forward; only the convolution changes). Left alone:
    layers that are kernelgen's already, lazy layers not yet initialised, and subclasses that
    compute the convolution themselves. Parameters (the same objects), buffers, hooks, the
    training flag, device, dtype and `state_dict` keys are kept.

    example_inputs: a tuple of the model's positional arguments, or its one argument. When given, the
        model is run on them once (in eval mode and under no_grad, so BatchNorm statistics are
        not updated), recording each layer's call for `report`.
    fold_bn: fold each BatchNorm2d that directly follows a convolution (its only user) into the
        convolution's weight and bias, and replace it with nn.Identity. Needs eval mode: folding
        uses the running statistics. Pairs are found with torch.fx where the model traces, else
        as adjacent children of an nn.Sequential. The state_dict changes accordingly (the bn's
        keys go; a conv without bias gains one). Not undone by `revert`.
    fuse: put each convolution's following residual add and activation into the convolution's
        call (kernelgen.conv2d's epilogue): conv [-> add] [-> activation], the conv's output read by
        nothing else. Activations: ReLU, ReLU6 (Hardtanh(0, 6)), LeakyReLU, SiLU, GELU (exact),
        Hardswish, Hardsigmoid, Sigmoid, as modules, functions or tensor methods, in place or not;
        add: `+`, `+=`, torch.add, Tensor.add(_). With fold_bn, conv -> BatchNorm -> ReLU becomes one
        call. Needs eval mode. Sites are found with torch.fx where the model traces (its forward
        becomes a FusedForward running the fused trace), else in each nn.Sequential (conv, then
        the activation module). In place: the model and its submodules stay the same objects;
        no module is removed, an activation is skipped only at the call it was fused into.
        A residual the kernel cannot take at run time (another dtype, under autocast, or
        broadcast) is added, and the activation applied, by torch after kernelgen's
        convolution: counted (kernelgen.stats()['epilogues_in_torch']) and shown by `report`.
    tune: measure each recorded call's candidates on this device (kernelgen.tune_calls) and keep
        the fastest; needs example_inputs. The recorded call is the one the layer makes: with
        fuse, its epilogue (activation, residual) too, so the fused kernel is the one tuned.
    fallback: None, or 'torch': a layer whose kernelgen call (tuned, where `tune`) is slower than
        torch on the example inputs keeps torch's convolution; logged at INFO, counted
        (kernelgen.stats()['convert_fallbacks']) and marked in the report. Needs example_inputs.
        A fused call is timed against F.conv2d followed by torch's add and activation, which is
        what the layer computes after falling back.
    """
    if fallback not in FALLBACKS:
        raise ValueError(f"fallback={fallback!r}: expected one of {FALLBACKS}")
    if (tune or fallback) and example_inputs is None:
        raise ValueError(f"{'tune=True' if tune else f'fallback={fallback!r}'} needs example_inputs: the layers "
                         "are measured on the calls the model makes on them")
    if fuse and model.training:
        raise ValueError("fuse=True needs the model in eval mode (call model.eval() first): the fused forward is "
                         "the model as torch.fx traces it in eval mode")
    folded = fold_batchnorm(model) if fold_bn else {}
    for m in model.modules():
        target = _target_class(m)
        if target is not None:
            _swap(m, target)
        layer = getattr(m, ATTR, None)
        if m in folded and layer is not None:
            layer.bn = folded[m]
    if fuse:
        fuse_epilogues(model)
    if example_inputs is not None:
        calls = _record(model, example_inputs)
        if tune:
            _tune(calls)
        if tune or fallback:
            _measure(model, calls, fallback)
    return model


def revert(model: nn.Module) -> nn.Module:
    """Undo `convert` in place (returns `model`): every converted layer gets its original class
    back, a kernelgen.Conv2d built directly becomes a torch.nn.Conv2d, and a fused forward goes
    (each module runs its own class's forward again). Parameters, buffers and state_dict are
    kept, so outputs match the model before `convert` (a folded BatchNorm stays folded). A 16-bit
    conv's folded BatchNorm scale (the buffer `bn_scale`, which torch's Conv2d would ignore) is
    folded into its weight then, rounded to the weight's dtype, and the buffer dropped: the plain
    torch model computes what the converted one did, with that one rounding more."""
    for m in model.modules():
        if BN_SCALE in m._buffers and isinstance(m, nn.Conv2d):
            with torch.no_grad():
                s = m._buffers.pop(BN_SCALE)
                m.weight.copy_(m.weight.double() * s.double().reshape(-1, 1, 1, 1))
        if isinstance(m.__dict__.get("forward"), FusedForward):
            del m.__dict__["forward"]
        layer = m.__dict__.pop(ATTR, None)
        if layer is not None:
            m.__class__ = layer.original
            if layer.added_precision:
                m.__dict__.pop("precision", None)
        elif type(m) is KgConv2d:
            if m.precision is not None:
                log.info("kernelgen.revert: a kernelgen.Conv2d with precision=%r becomes a torch.nn.Conv2d, "
                         "which follows torch's TF32 setting instead", m.precision)
            m.__class__ = nn.Conv2d
            m.__dict__.pop("precision", None)
    return model


# --- conversion -----------------------------------------------------------------------------------

_subclasses: dict[type, type] = {}
# While `_record` runs: layer -> its call (kernelgen.conv2d's arguments). One recording at a time per
# process: the hooks and the subclasses' _conv_forward write here.
_calls: dict | None = None


def _target_class(m: nn.Module) -> type | None:
    """The kernelgen class `m` becomes, or None where it is not converted."""
    cls = type(m)
    if not isinstance(m, nn.Conv2d) or isinstance(m, KgConv2d):
        return None
    if isinstance(m, nn.modules.lazy.LazyModuleMixin) and m.has_uninitialized_params():
        log.debug("kernelgen.convert: %s is a lazy layer not yet initialised; left on torch", cls.__name__)
        return None
    if cls is nn.Conv2d:
        return KgConv2d
    code = getattr(cls.forward, "__code__", None)  # (None: a wrapped forward, which we cannot read)
    if cls._conv_forward is not nn.Conv2d._conv_forward or (
            cls.forward is not nn.Conv2d.forward and (code is None or "_conv_forward" not in code.co_names)):
        log.debug("kernelgen.convert: %s computes its convolution itself (not through "
                  "torch.nn.Conv2d._conv_forward); left on torch", cls.__qualname__)
        return None
    return _subclass(cls)


def _subclass(cls: type) -> type:
    """`cls` (a torch.nn.Conv2d subclass) with its convolution on kernelgen: its own forward
    first in the method order, then kernelgen.Conv2d's; `_conv_forward` calls kernelgen.conv2d.
    One class per `cls`, so converted layers of one class share a type."""
    sub = _subclasses.get(cls)
    if sub is None:
        sub = _subclasses[cls] = type(cls.__name__, (cls, KgConv2d), {
            "_conv_forward": _kg_conv_forward, "__reduce_ex__": _reduce_ex, "__module__": cls.__module__,
            "__qualname__": cls.__qualname__, "__doc__": cls.__doc__})
    return sub


def _reduce_ex(self, protocol):
    # A class made at run time cannot be pickled by name: pickle (and deepcopy) the layer as its
    # original class, and make the kernelgen subclass again on loading.
    return _rebuild, (type(self).__mro__[1],), self.__getstate__()


def _rebuild(cls: type) -> nn.Module:
    sub = _subclass(cls)
    return sub.__new__(sub)


def _kg_conv_forward(self, input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """torch.nn.Conv2d._conv_forward, computed by kernelgen.conv2d."""
    padding = self.padding
    if self.padding_mode != "zeros":
        input, padding = F.pad(input, self._reversed_padding_repeated_twice, mode=self.padding_mode), 0
    if _calls is not None:  # the subclass may pass a weight of its own making: record what is convolved
        _calls[self] = _call(self, input, weight, bias, padding)
    return conv2d(input, weight, bias, self.stride, padding, self.dilation, self.groups, precision=self.precision,
                  scale=self._buffers.get(BN_SCALE))  # (a folded BatchNorm's, 16-bit; None: a plain call)


def _swap(m: nn.Module, target: type) -> None:
    layer = m.__dict__.get(ATTR)
    if layer is None:
        layer = Layer(original=type(m), added_precision="precision" not in m.__dict__)
    layer.fallback = None
    m.__class__ = target
    if layer.added_precision:
        m.precision = None  # kernelgen.Conv2d's attribute: follow torch's TF32 setting
    m.__dict__[ATTR] = layer


# --- BatchNorm folding ----------------------------------------------------------------------------

def fold_batchnorm(model: nn.Module) -> dict[nn.Module, str]:
    """Fold each BatchNorm2d that directly follows a convolution into it (see `convert`'s
    fold_bn); returns {conv: the folded bn's qualified name}. Eval mode only."""
    if model.training:
        raise ValueError("fold_bn=True needs the model in eval mode (call model.eval() first): folding uses "
                         "BatchNorm's running statistics, which a model in training mode does not use")
    names = {m: n for n, m in model.named_modules()}
    folded = {}
    for conv_name, bn_name in _conv_bn_pairs(model):
        conv, bn = model.get_submodule(conv_name), model.get_submodule(bn_name)
        if bn.training:
            raise ValueError(f"fold_bn=True: {bn_name} is in training mode though the model is not; call "
                             f"model.eval() so that every BatchNorm uses its running statistics")
        _fold(conv, bn)
        parent, _, leaf = bn_name.rpartition(".")
        setattr(model.get_submodule(parent), leaf, nn.Identity())
        folded[conv] = bn_name
        log.debug("kernelgen.convert: folded %s into %s", bn_name, names[conv])
    return folded


def _foldable_conv(m: nn.Module) -> bool:
    """A convolution whose output is conv(input, self.weight, self.bias): torch's or kernelgen's
    own forward (a subclass may transform its weight first, and could not be folded into)."""
    cls = type(m)
    return (isinstance(m, nn.Conv2d) and cls.forward in (nn.Conv2d.forward, KgConv2d.forward)
            and cls._conv_forward in (nn.Conv2d._conv_forward, _kg_conv_forward))


def _foldable_bn(m: nn.Module, conv: nn.Module) -> bool:
    return (isinstance(m, nn.BatchNorm2d) and type(m).forward is nn.BatchNorm2d.forward
            and m.running_mean is not None and m.num_features == conv.out_channels)


def _conv_bn_pairs(model: nn.Module) -> list[tuple[str, str]]:
    """(conv, bn) qualified names where the bn's only input is the conv's output and nothing else
    reads that output; each module called once. From torch.fx where the model traces, else from
    adjacent children of nn.Sequential."""
    mods = dict(model.named_modules())
    try:
        graph = _trace(_LeafTracer(), model)
    except Exception as exc:  # noqa: BLE001 (fx raises many types on what it cannot trace; the patterns follow)
        log.debug("kernelgen.convert: torch.fx cannot trace %s (%s: %s); folding BatchNorm by module patterns",
                  type(model).__name__, type(exc).__name__, exc)
        return _sequential_pairs(model)
    calls = Counter(n.target for n in graph.nodes if n.op == "call_module")
    pairs = []
    for n in graph.nodes:
        if n.op != "call_module" or calls[n.target] != 1 or len(n.users) != 1 or not _foldable_conv(mods[n.target]):
            continue
        (u,) = n.users
        if (u.op == "call_module" and calls[u.target] == 1 and u.args[:1] == (n,) and len(u.args) == 1
                and not u.kwargs and _foldable_bn(mods[u.target], mods[n.target])):
            pairs.append((n.target, u.target))
    return pairs


def _trace(tracer: torch.fx.Tracer, model: nn.Module, **kwargs) -> torch.fx.Graph:
    """tracer.trace(model), and the tracer then emptied: it is in a reference cycle with its graph
    and holds the model, which would otherwise live on (with its memory) until a garbage collection."""
    try:
        return tracer.trace(model, **kwargs)
    finally:
        tracer.__dict__.clear()


class _LeafTracer(torch.fx.Tracer):
    """torch.fx's tracer, keeping every Conv2d (subclasses too) and BatchNorm2d one node."""

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return isinstance(m, (nn.Conv2d, nn.BatchNorm2d)) or super().is_leaf_module(m, qualname)


def _sequential_pairs(model: nn.Module) -> list[tuple[str, str]]:
    uses = Counter(id(m) for _, m in model.named_modules(remove_duplicate=False))
    pairs = []
    for name, seq in model.named_modules():
        if not isinstance(seq, nn.Sequential) or type(seq).forward is not nn.Sequential.forward:
            continue
        children = list(seq.named_children())
        for (a_name, a), (b_name, b) in zip(children, children[1:]):
            if (_foldable_conv(a) and _foldable_bn(b, a) and uses[id(a)] == 1 and uses[id(b)] == 1):
                prefix = f"{name}." if name else ""
                pairs.append((prefix + a_name, prefix + b_name))
    return pairs


@torch.no_grad()
def _fold(conv: nn.Conv2d, bn: nn.BatchNorm2d) -> None:
    """conv's weight and bias made those of bn(conv(x)) in eval mode, computed in float64. The
    weight is updated in place (the same Parameter); a conv without bias gains one.

    A float16/bfloat16 conv keeps its weight as it is: rounding w * scale to 16 bits a second time
    costs ResNet-50's bf16 logits 1.66x eager's error (benchmarks/results/cpu_fold_accuracy.md).
    It gains the scale as a float32 buffer `bn_scale` instead, which the kernel's epilogue applies
    to its float32 accumulator before the (folded, 16-bit) bias: 0.93x eager's error. Grouped and
    depthwise convs too: their families multiply the taps by it as they convert them to float32."""
    scale = torch.rsqrt(bn.running_var.double() + bn.eps)
    if bn.weight is not None:
        scale = scale * bn.weight.double()
    shift = -bn.running_mean.double() * scale
    if bn.bias is not None:
        shift = shift + bn.bias.double()
    w = conv.weight
    bias = shift if conv.bias is None else conv.bias.double() * scale + shift
    if w.dtype in (torch.float16, torch.bfloat16):
        if BN_SCALE in conv._buffers:  # (folded twice: the scales compose, as the bias just did)
            scale = scale * conv._buffers[BN_SCALE].double()
        conv.register_buffer(BN_SCALE, scale.to(device=w.device, dtype=torch.float32), persistent=True)
    else:
        w.copy_(w.double() * scale.reshape(-1, 1, 1, 1))
    if conv.bias is None:
        conv.bias = nn.Parameter(bias.to(device=w.device, dtype=w.dtype), requires_grad=w.requires_grad)
    else:
        conv.bias.copy_(bias)


# --- epilogue fusion ------------------------------------------------------------------------------

# kernelgen.conv2d's activations as torch computes them: a fused call whose residual the kernel
# cannot take applies its activation with these.
TORCH_ACTIVATIONS = compiled.TORCH_ACTIVATIONS

_MODULE_ACTIVATIONS = {nn.ReLU: "relu", nn.ReLU6: "hardtanh", nn.Hardtanh: "hardtanh", nn.LeakyReLU: "leaky_relu",
                       nn.SiLU: "silu", nn.GELU: "gelu", nn.Hardswish: "hardswish", nn.Hardsigmoid: "hardsigmoid",
                       nn.Sigmoid: "sigmoid"}
# Functions as torch.fx records them: the activation, and their parameters in order (the first is the input).
_FUNCTION_ACTIVATIONS = {
    F.relu: ("relu", ("input", "inplace")), torch.relu: ("relu", ("input",)), torch.relu_: ("relu", ("input",)),
    F.relu6: ("relu6", ("input", "inplace")),
    F.hardtanh: ("hardtanh", ("input", "min_val", "max_val", "inplace")),
    F.hardtanh_: ("hardtanh", ("input", "min_val", "max_val")),
    F.leaky_relu: ("leaky_relu", ("input", "negative_slope", "inplace")),
    F.leaky_relu_: ("leaky_relu", ("input", "negative_slope")),
    F.silu: ("silu", ("input", "inplace")), F.gelu: ("gelu", ("input", "approximate")),
    F.hardswish: ("hardswish", ("input", "inplace")), F.hardsigmoid: ("hardsigmoid", ("input", "inplace")),
    torch.sigmoid: ("sigmoid", ("input",)), torch.sigmoid_: ("sigmoid", ("input",)), F.sigmoid: ("sigmoid", ("input",)),
}
_METHOD_ACTIVATIONS = {"relu": "relu", "relu_": "relu", "sigmoid": "sigmoid", "sigmoid_": "sigmoid"}
_DEFAULTS = {"inplace": False, "min_val": -1.0, "max_val": 1.0, "negative_slope": 0.01, "approximate": "none"}
# Operators that change their first operand (`x += y`, `x[i] = y`): a node between a convolution and
# the add fused into it must not be one, since the fused call moves the convolution to the add.
_INPLACE_OPERATORS = {operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv,
                      operator.imod, operator.ipow, operator.iand, operator.ior, operator.ixor, operator.ilshift,
                      operator.irshift, operator.imatmul, operator.setitem, operator.delitem}


def fused_call(conv: nn.Module, input, residual, activation: str | None, negative_slope: float,
               add: str | None) -> torch.Tensor:
    """One fused site of a model converted with fuse=True: activation(conv(input) + residual).

    The epilogue goes into conv's kernel (the layer's forward passes it to kernelgen.conv2d) where
    the kernel can take it: always for an activation alone, and for a residual of exactly the
    output's shape, dtype and device. Otherwise (a residual of another dtype, as under autocast,
    one that broadcasts, or not a tensor) kernelgen computes the convolution and torch the add
    (in place where the model wrote `+=`: `add` is 'iadd') and the activation, with torch's
    semantics; counted as kernelgen.stats()['epilogues_in_torch'] and in the layer's report row.
    A layer on torch (fallback='torch', or reverted) computes all of it with torch, as unfused.
    """
    on_kernelgen = type(conv).forward is KgConv2d.forward
    if on_kernelgen and (residual is None or _fits(conv, input, residual)):
        return conv(input, activation=activation, negative_slope=negative_slope, residual=residual)
    if on_kernelgen:
        count("epilogues_in_torch")
        layer = conv.__dict__.get(ATTR)
        if layer is not None:
            if layer.epilogue_in_torch == 0:
                log.info("kernelgen: a fused Conv2d(%s) gets a residual its kernel cannot take (%s, output %s %s); "
                         "torch adds it and applies %s (kernelgen.report counts such calls)", conv.extra_repr(),
                         _describe_value(residual), tuple(_out_shape(conv, input)), _out_dtype(input), activation)
            layer.epilogue_in_torch += 1
    y = conv(input)
    if add == "iadd":
        y = operator.iadd(y, residual)
    elif add is not None:
        y = y + residual
    return y if activation is None else TORCH_ACTIVATIONS[activation](y, negative_slope)


def _describe_value(v) -> str:
    return f"{v.dtype} {tuple(v.shape)}" if isinstance(v, torch.Tensor) else type(v).__name__


def _out_dtype(input: torch.Tensor) -> torch.dtype:
    """The dtype of kernelgen.conv2d's output for `input`: the input's, or autocast's (as F.conv2d)."""
    dtype, device = input.dtype, input.device.type
    if ((device == "cuda" or device == "cpu") and torch.is_autocast_enabled(device) and dtype.is_floating_point
            and dtype is not torch.float64):
        return torch.get_autocast_dtype(device)
    return dtype


def _out_shape(conv: nn.Module, input: torch.Tensor) -> torch.Size:
    """The shape of conv(input), batched or not (non-'zeros' padding modes pad by the same amount)."""
    h, w = input.shape[-2:]
    if conv.padding == "same":
        return torch.Size((*input.shape[:-3], conv.out_channels, h, w))
    (ph, pw) = (0, 0) if conv.padding == "valid" else conv.padding
    (kh, kw), (sh, sw), (dh, dw) = conv.kernel_size, conv.stride, conv.dilation
    return torch.Size((*input.shape[:-3], conv.out_channels, (h + 2 * ph - dh * (kh - 1) - 1) // sh + 1,
                       (w + 2 * pw - dw * (kw - 1) - 1) // sw + 1))


def _fits(conv: nn.Module, input, residual) -> bool:
    """Whether kernelgen.conv2d's epilogue takes `residual` for this call: a tensor of exactly the
    output's shape, dtype and device."""
    return (isinstance(residual, torch.Tensor) and isinstance(input, torch.Tensor) and input.dim() >= 3
            and residual.device == input.device and residual.dtype == _out_dtype(input)
            and residual.shape == _out_shape(conv, input))


def fuse_epilogues(model: nn.Module) -> int:
    """Fuse each convolution's following residual add and activation into its call (see
    `convert`'s fuse), in place; returns the number of fused sites. Converted layers' `fused`
    records are rewritten."""
    for m in model.modules():
        if isinstance(m.__dict__.get("forward"), FusedForward):  # an earlier convert's: fused afresh below
            del m.__dict__["forward"]
        layer = m.__dict__.get(ATTR)
        if layer is not None:
            layer.fused, layer.epilogue_in_torch = [], 0
    names = {m: n for n, m in model.named_modules()}
    total = 0
    for owner, graph, required in _fusion_graphs(model):
        mods = dict(owner.named_modules())
        sites = _fuse_graph(graph, mods)
        if not sites:
            continue
        graph.lint()
        for conv, description in sites:
            if ATTR in conv.__dict__:
                conv.__dict__[ATTR].fused.append(description)
            log.debug("kernelgen.convert: fused %s into %s", description, names.get(conv, type(conv).__name__))
        owner.__dict__["forward"] = FusedForward(owner, graph, required)
        total += len(sites)
    return total


def _fusion_graphs(model: nn.Module) -> list[tuple[nn.Module, torch.fx.Graph, int]]:
    """(module, its forward as a graph, its number of required arguments) to fuse in: the model's
    torch.fx trace where it traces, else each nn.Sequential's chain of children."""
    traced = _trace_for_fusion(model)
    if traced is not None:
        return [(model, *traced)]
    out = []
    for seq in model.modules():
        if type(seq).forward is nn.Sequential.forward and not _own_forward(seq):
            graph = torch.fx.Graph()
            x = graph.placeholder("input")
            for name, _ in seq.named_children():
                x = graph.call_module(name, (x,))
            graph.output(x)
            out.append((seq, graph, 1))
    return out


def _own_forward(m: nn.Module) -> bool:
    """Whether `m` has a forward of its own (an instance attribute, not convert's): its class's
    forward, which torch.fx traces, is not what it runs."""
    return "forward" in m.__dict__ and not isinstance(m.__dict__["forward"], FusedForward)


def _trace_for_fusion(model: nn.Module) -> tuple[torch.fx.Graph, int] | None:
    """(graph, required arguments) of the model's forward as torch.fx traces it, its optional
    arguments fixed at their defaults (FusedForward runs it only for such calls); None where it
    does not trace."""
    if _own_forward(model):
        log.debug("kernelgen.convert: %s has a forward of its own; fusing by module patterns", type(model).__name__)
        return None
    params = list(inspect.signature(type(model).forward).parameters.values())[1:]
    if any(p.kind not in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params):
        log.debug("kernelgen.convert: %s.forward takes *args, **kwargs or keyword-only arguments; fusing by module "
                  "patterns", type(model).__name__)
        return None
    defaults = {p.name: p.default for p in params if p.default is not p.empty}
    if any(v is not None and type(v) not in (bool, int, float, str) for v in defaults.values()):
        log.debug("kernelgen.convert: %s.forward has a default other than None, a bool, a number or a string; "
                  "fusing by module patterns", type(model).__name__)
        return None
    try:
        graph = _trace(_FuseTracer(), model, concrete_args=defaults or None)
    except Exception as exc:  # noqa: BLE001 (fx raises many types on what it cannot trace; the patterns follow)
        log.debug("kernelgen.convert: torch.fx cannot trace %s (%s: %s); fusing by module patterns",
                  type(model).__name__, type(exc).__name__, exc)
        return None
    return graph, len(params) - len(defaults)


class _InplaceProxy(torch.fx.Proxy):
    """A proxy that records `x += y` as operator.iadd, not as `x + y` (fx's Proxy has no __iadd__,
    so Python falls back to __add__): the traced code then changes x in place as the model does,
    and keeps x's dtype where y's differs."""


def _inplace_dunder(op):
    def method(self, other):
        return self.tracer.create_proxy("call_function", op, (self, other), {})
    return method


for _op in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "and", "or", "xor", "lshift", "rshift",
            "matmul"):
    setattr(_InplaceProxy, f"__i{_op}__", _inplace_dunder(getattr(operator, f"i{_op}")))


class _FuseTracer(_LeafTracer):
    def proxy(self, node: torch.fx.Node) -> torch.fx.Proxy:
        return _InplaceProxy(node, self)


def _fusable_conv(m: nn.Module | None) -> bool:
    """A layer on kernelgen whose forward is kernelgen.Conv2d's (which takes the epilogue) and
    whose output no forward hook reads (fused, the output would be the activation's)."""
    return m is not None and type(m).forward is KgConv2d.forward and not m._forward_hooks


def _only_user(n: torch.fx.Node) -> torch.fx.Node | None:
    return next(iter(n.users)) if len(n.users) == 1 else None


def _is_identity(m: nn.Module) -> bool:
    return type(m) is nn.Identity and not m._forward_hooks and not m._forward_pre_hooks


def _bind(params: tuple, args: tuple, kwargs: dict) -> dict | None:
    if len(args) > len(params) or any(k not in params[len(args):] for k in kwargs):
        return None
    bound = dict(zip(params, args), **kwargs)
    return {p: bound.get(p, _DEFAULTS.get(p)) for p in params}


def _node_activation(n: torch.fx.Node, mods: dict) -> tuple[Any, str, float] | None:
    """(input, activation, negative_slope) where node `n` applies one of kernelgen.conv2d's
    activations to `input`, else None."""
    if n.op == "call_module":
        m = mods[n.target]
        name = _MODULE_ACTIVATIONS.get(type(m))
        if name is None or len(n.args) != 1 or n.kwargs or m._forward_hooks or m._forward_pre_hooks:
            return None  # (an activation module's hooks would not run where it is fused)
        values = {"input": n.args[0], "min_val": getattr(m, "min_val", None), "max_val": getattr(m, "max_val", None),
                  "negative_slope": getattr(m, "negative_slope", 0.01), "approximate": getattr(m, "approximate", None)}
    elif n.op == "call_method":
        name = _METHOD_ACTIVATIONS.get(n.target)
        if name is None or len(n.args) != 1 or n.kwargs:
            return None
        values = {"input": n.args[0]}
    elif n.op == "call_function":
        try:
            name, params = _FUNCTION_ACTIVATIONS[n.target]
        except (KeyError, TypeError):
            return None
        values = _bind(params, n.args, n.kwargs)
        if values is None or any(isinstance(v, torch.fx.Node) for k, v in values.items() if k != "input"):
            return None
    else:
        return None
    if name == "hardtanh":
        if (values["min_val"], values["max_val"]) != (0, 6):
            return None
        name = "relu6"
    if name == "gelu" and values.get("approximate", "none") != "none":
        return None
    slope = values.get("negative_slope", 0.01) if name == "leaky_relu" else 0.01
    return values["input"], name, float(slope)


def _node_add(n: torch.fx.Node) -> tuple[Any, Any, str] | None:
    """(a, b, 'add' or 'iadd') where node `n` is a + b (`iadd`: a += b, a changed in place), else None."""
    args, kwargs = n.args, dict(n.kwargs)
    if n.op == "call_function" and n.target in (operator.add, operator.iadd) and len(args) == 2 and not kwargs:
        return args[0], args[1], "iadd" if n.target is operator.iadd else "add"
    if (n.op == "call_function" and n.target is torch.add) or (n.op == "call_method" and n.target in ("add", "add_")):
        alpha = kwargs.pop("alpha", 1)
        if len(args) == 2 and not kwargs and not isinstance(alpha, torch.fx.Node) and alpha == 1:
            return args[0], args[1], "iadd" if n.target == "add_" else "add"
    return None


def _may_mutate(n: torch.fx.Node, mods: dict) -> bool:
    """Whether node `n` may change a tensor in place (conservatively)."""
    if n.op == "call_module":
        m = mods[n.target]
        pure = type(m).__module__.startswith("torch.nn.") or type(m).forward is KgConv2d.forward
        return not pure or bool(getattr(m, "inplace", False))
    if n.op == "call_method":
        return n.target.endswith("_") or n.target.startswith("__set")
    if n.op != "call_function":
        return False
    if n.target in _INPLACE_OPERATORS or "out" in n.kwargs or n.kwargs.get("inplace") is True:
        return True
    name = getattr(n.target, "__name__", "")
    if name.endswith("_") and not name.endswith("__"):
        return True
    try:
        return inspect.signature(n.target).bind(*n.args, **n.kwargs).arguments.get("inplace") is True
    except (TypeError, ValueError):
        return False


def _between(a: torch.fx.Node, b: torch.fx.Node):
    """The nodes after `a` and before `b` in the graph's order."""
    n = a.next
    while n is not b:
        yield n
        n = n.next


def _describe(residual: bool, activation: str | None, slope: float) -> str:
    parts = ["+residual"] if residual else []
    if activation == "leaky_relu" and slope != 0.01:
        parts.append(f"leaky_relu({slope:g})")
    elif activation is not None:
        parts.append(activation)
    return ", ".join(parts)


def _fuse_graph(graph: torch.fx.Graph, mods: dict) -> list[tuple[nn.Module, str]]:
    """Rewrite each conv [-> nn.Identity]* [-> add] [-> activation] of `graph` as one fused_call
    node; returns (conv, description) per site. Each step's output must be read only by the next.
    The call takes the add's place (where the residual exists: torchvision's Bottleneck computes
    it after the convolution), so a site whose convolution would then read its input after a
    node that may change a tensor in place keeps its add unfused."""
    sites = []
    for conv in list(graph.nodes):
        if conv.op != "call_module" or len(conv.args) != 1 or conv.kwargs or not _fusable_conv(mods.get(conv.target)):
            continue
        chain, end = [conv], conv
        while ((u := _only_user(end)) is not None and u.op == "call_module" and _is_identity(mods[u.target])
               and u.args == (end,) and not u.kwargs):
            chain.append(u)
            end = u
        residual = add = None
        anchor = conv  # where the fused call goes: the add's place where there is one, else the conv's
        u = _only_user(end)
        if u is not None and (found := _node_add(u)) is not None:
            a, b, form = found
            other = b if a is end else a if b is end else None
            if (isinstance(other, torch.fx.Node) and other is not end and (form == "add" or a is end)
                    and not any(_may_mutate(n, mods) for n in _between(conv, u) if n not in chain)):
                residual, add = other, form
                chain.append(u)
                end = anchor = u
        activation, slope = None, 0.01
        u = _only_user(end)
        if u is not None and (found := _node_activation(u, mods)) is not None and found[0] is end:
            _, activation, slope = found
            chain.append(u)
            end = u
        if residual is None and activation is None:
            continue
        with graph.inserting_before(anchor):
            module = graph.get_attr(conv.target)
            fused = graph.call_function(fused_call, (module, conv.args[0], residual, activation, slope, add))
        end.replace_all_uses_with(fused)
        for n in reversed(chain):
            graph.erase_node(n)
        sites.append((mods[conv.target], _describe(residual is not None, activation, slope)))
    return sites


class FusedForward:
    """A module's `forward` while `convert(..., fuse=True)` holds it (an instance attribute):
    the module's forward as torch.fx traced it, with fused calls, run on the module itself.

    It serves calls in eval mode whose optional arguments are their defaults (what was traced);
    any other call, and every call in training mode, runs the class's own forward (its
    convolutions still on kernelgen, unfused). `code` is the Python it runs. It holds its module
    weakly (no reference cycle keeps a model's memory alive) and pickles and deep-copies with it.
    """

    _names = itertools.count()

    def __init__(self, owner: nn.Module, graph: torch.fx.Graph, required: int):
        code = graph.python_code(root_module="self")
        self._init(owner, code.src, {k: v for k, v in code.globals.items() if k != "__builtins__"}, required)

    def _init(self, owner: nn.Module, src: str, globals_: dict, required: int) -> None:
        self._owner = weakref.ref(owner)
        self.code, self._globals, self._required = src, globals_, required
        # registered with linecache, so tracebacks through the fused forward show its lines
        filename = f"<kernelgen fused forward {next(self._names)}>"
        linecache.cache[filename] = (len(src), None, src.splitlines(True), filename)
        namespace = dict(globals_)
        exec(compile(src, filename, "exec"), namespace)  # noqa: S102 (fx's code for the traced graph)
        self._fn = namespace["forward"]

    def __call__(self, *args, **kwargs):
        owner = self._owner()
        if owner is None:
            raise ReferenceError("this fused forward's module no longer exists (a FusedForward holds it weakly)")
        if not owner.training:
            if not kwargs and len(args) == self._required:
                return self._fn(owner, *args)
            required = self._required_only(owner, args, kwargs)
            if required is not None:
                return self._fn(owner, *required)
        return type(owner).forward(owner, *args, **kwargs)

    def _required_only(self, owner: nn.Module, args: tuple, kwargs: dict) -> list | None:
        """The required arguments of a call whose optional ones are absent or their defaults."""
        signature = inspect.signature(type(owner).forward)
        try:
            bound = signature.bind(owner, *args, **kwargs)
        except TypeError:
            return None
        params = list(signature.parameters.values())[1:]
        for p in params[self._required:]:
            if p.name in bound.arguments and not _same(bound.arguments[p.name], p.default):
                return None
        return [bound.arguments[p.name] for p in params[:self._required]]

    def __repr__(self) -> str:
        owner = self._owner()
        return (f"<kernelgen fused forward of {type(owner).__name__}: print(.code) shows it; "
                "kernelgen.revert removes it>")

    def __reduce__(self):
        modules = {k: v.__name__ for k, v in self._globals.items() if isinstance(v, types.ModuleType)}
        objects = {k: v for k, v in self._globals.items() if k not in modules}
        return _load_fused_forward, (self._owner(), self.code, modules, objects, self._required)


def _load_fused_forward(owner, src, modules, objects, required) -> FusedForward:
    f = FusedForward.__new__(FusedForward)
    f._init(owner, src, {**{k: importlib.import_module(v) for k, v in modules.items()}, **objects}, required)
    return f


def _same(value, default) -> bool:
    return value is default or (type(value) in (bool, int, float, str) and type(value) is type(default)
                                and value == default)


# --- recording, tuning, measuring -----------------------------------------------------------------

def _call(m: nn.Module, input, weight, bias, padding, activation=None, negative_slope=0.01, residual=None) -> dict:
    # detached: the tuner turns errors into floats, and nothing here needs their graph; the scale of
    # a folded BatchNorm (16-bit) is part of the call the layer makes
    return dict(input=input.detach(), weight=weight.detach(), bias=None if bias is None else bias.detach(),
                stride=m.stride, padding=padding, dilation=m.dilation, groups=m.groups, precision=m.precision,
                activation=activation, negative_slope=negative_slope,
                residual=residual.detach() if isinstance(residual, torch.Tensor) else residual,
                scale=m._buffers.get(BN_SCALE))


def _pre_hook(m: nn.Module, args: tuple, kwargs: dict) -> None:
    """Record the call `m` is about to make; a fused call's epilogue comes as kernelgen.Conv2d's
    keyword arguments (fused_call passes them, the residual being the model's own tensor)."""
    x, padding = (args[0] if args else kwargs["input"]), m.padding
    if m.padding_mode != "zeros":
        x, padding = F.pad(x, m._reversed_padding_repeated_twice, mode=m.padding_mode), 0
    epilogue = {}
    if type(m).forward is KgConv2d.forward:  # (another forward's keywords are not kernelgen.conv2d's)
        epilogue = {k: kwargs[k] for k in ("activation", "negative_slope", "residual") if k in kwargs}
    _calls[m] = _call(m, x, m.weight, m.bias, padding, **epilogue)


def _record(model: nn.Module, example_inputs: Any) -> dict[nn.Module, dict]:
    """Run `model` once on `example_inputs` (eval mode, no_grad; the training flags restored
    after) and return each converted layer's call (its last, where it is called several times),
    as the layer makes it: a fused call with its activation, slope and residual; each layer's
    Layer gets the call's input, epilogue and plan."""
    global _calls
    args = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
    layers = [m for m in model.modules() if ATTR in m.__dict__]  # fallback layers too, for report
    modes = {m: m.training for m in model.modules()}
    handles = [m.register_forward_pre_hook(_pre_hook, with_kwargs=True) for m in layers]
    calls: dict = {}
    _calls = calls
    try:
        model.eval()
        with torch.no_grad():
            model(*args)
    finally:
        _calls = None
        for h in handles:
            h.remove()
        for m, training in modes.items():
            m.training = training
    for m, call in calls.items():
        x = call["input"]
        layer = getattr(m, ATTR)
        layer.input = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta")
        layer.epilogue = _describe(call["residual"] is not None, call["activation"], call["negative_slope"]) or None
        layer.plan, layer.tuned = _plan_of(call)
    return calls


def _signature(call: dict) -> tuple | None:
    """The plan signature of a recorded call, its epilogue included: a fused and a bare call of
    one shape are different plans (and kernels)."""
    from . import functional
    from .tuner import _planned  # (the call without its slope, which is no part of a plan)

    return functional.signature(**_planned(call), family=None, tiles=None)


def _plan_of(call: dict) -> tuple[str | None, bool]:
    """(the kernel's summary, whether it was tuned) that kernelgen.conv2d serves for `call`: its
    plan record where there is one, else the selector's choice."""
    from . import functional, plans, tuner
    from .kernels import default_cache

    sig = _signature(call)
    record = plans.read(default_cache().root, functional._record_name(sig, call["input"])) if sig else None
    if record and record.get("summary"):
        return record["summary"], isinstance(record.get("tuned"), dict)
    spec, _ = functional.spec_for(**tuner._planned(call))
    return (spec.summary() if spec is not None else None), False


def _unique(calls: dict) -> dict[tuple, dict]:
    """One call per plan signature: layers of identical calls (epilogues included) are tuned and
    timed once."""
    out = {}
    for call in calls.values():
        out.setdefault(_signature(call), call)
    return out


def _tune(calls: dict) -> None:
    from .tuner import tune_calls

    unique = list(_unique(calls).values())
    log.info("kernelgen.convert: tuning %d distinct convolution(s) of %d layer(s)", len(unique), len(calls))
    tune_calls(unique)
    for m, call in calls.items():
        getattr(m, ATTR).plan, getattr(m, ATTR).tuned = _plan_of(call)


def _time_call(call: dict) -> tuple[float, float]:
    """(kernelgen's, torch's) microseconds for `call`, timed by the tuner's clock (CUDA events on a
    GPU, the host clock on the CPU), the two taking turns. kernelgen's: kernelgen.conv2d with the
    call's epilogue; torch's: F.conv2d, then the residual add and the activation by torch
    (compiled.epilogue), the ops a fused call replaces (with a folded BatchNorm's scale, its
    multiply and the bias after it)."""
    from . import tuner

    x, w, b, scale = call["input"], call["weight"], call["bias"], call["scale"]
    geometry = (call["stride"], call["padding"], call["dilation"], call["groups"])
    act, slope, res = call["activation"], call["negative_slope"], call["residual"]
    with torch.no_grad():
        kg, th = tuner._stream_us([
            lambda: conv2d(x, w, b, *geometry, precision=call["precision"], activation=act, negative_slope=slope,
                           residual=res, scale=scale),
            lambda: compiled.epilogue(F.conv2d(x, w, b if scale is None else None, *geometry), act, slope, res,
                                      scale, None if scale is None else b)], cuda=x.is_cuda)
    return kg, th


def _measure(model: nn.Module, calls: dict, fallback: str | None) -> None:
    """Time each distinct call (`_time_call`) into its layers' records; with fallback='torch', put
    a layer measured slower on kernelgen back on torch's convolution. A fused layer then computes
    its epilogue with torch too (fused_call), which is what its torch time measured."""
    times = {sig: _time_call(call) for sig, call in _unique(calls).items()}
    names = {m: n for n, m in model.named_modules()}
    for m, call in calls.items():
        layer = getattr(m, ATTR)
        layer.us, layer.torch_us = times[_signature(call)]
        if fallback == "torch" and layer.us > layer.torch_us and BN_SCALE not in m._buffers:
            # (a layer keeping a folded BatchNorm's scale stays on kernelgen: torch's conv cannot apply it)
            layer.fallback = "torch"
            m.__class__ = layer.original
            count("convert_fallbacks")
            torch_side = "F.conv2d" + (f" then {layer.epilogue} by torch" if layer.epilogue else "")
            log.info("kernelgen.convert: %s keeps torch's convolution: kernelgen %.1f us > %s %.1f us "
                     "(input %s, %s)", names.get(m, type(m).__name__), layer.us, torch_side, layer.torch_us,
                     tuple(call["input"].shape), layer.plan)


# --- report ---------------------------------------------------------------------------------------

@dataclasses.dataclass
class Report:
    """`kernelgen.report`'s table: `rows`, one dict per converted layer, and `str()` to print."""

    rows: list[dict]

    COLUMNS = (("name", "layer"), ("input", "input"), ("kernel", "kernel"), ("bn", "bn folded"), ("fused", "fused"),
               ("fallback", "fallback"), ("us", "kernelgen µs"), ("torch_us", "F.conv2d µs"))

    def __str__(self) -> str:
        def cell(key, v, row):
            if v is None:
                return "-"
            if key == "fused" and row["epilogue_in_torch"]:
                return f"{v} (torch ×{row['epilogue_in_torch']})"
            if key == "input":
                return "x".join(map(str, v))
            if isinstance(v, float):
                return f"{v:.1f}"
            return str(v)

        table = [[head for _, head in self.COLUMNS]]
        table += [[cell(k, r[k], r) for k, _ in self.COLUMNS] for r in self.rows]
        widths = [max(len(row[i]) for row in table) for i in range(len(self.COLUMNS))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in table]
        lines.insert(1, "  ".join("-" * w for w in widths))
        n_fb = sum(r["fallback"] is not None for r in self.rows)
        n_bn = sum(r["bn"] is not None for r in self.rows)
        n_fused = sum(r["fused"] is not None for r in self.rows)
        lines.append(f"{len(self.rows)} layer(s): {len(self.rows) - n_fb} on kernelgen, {n_fb} on torch "
                     f"(fallback), {n_bn} with BatchNorm folded, {n_fused} fused")
        if any(r["epilogue"] is not None and r["us"] is not None for r in self.rows):
            lines.append("µs of a fused layer are its whole call: kernelgen.conv2d with the epilogue against "
                         "F.conv2d, then torch's add and activation")
        return "\n".join(lines)


def report(model: nn.Module, example_inputs: Any = None) -> Report:
    """A table of `model`'s converted layers: qualified name, input shape, the kernel kernelgen runs
    (family[tiles]; `plan` in the rows has its whole summary, `tuned` whether it was measured),
    the BatchNorm folded in, the ops fused into its calls ("+residual, relu"; distinct ones joined
    by "; ", and "(torch ×n)" where n calls had torch compute them: `epilogue_in_torch`), fallback,
    and kernelgen's and torch's µs where convert measured them: for a fused layer, its whole call
    (`epilogue` in the rows: kernelgen.conv2d with it, against F.conv2d then torch's add and
    activation; a note under the table says so). Input and kernel are those of the last recorded
    call: `convert`'s example inputs, or `example_inputs` here, which runs the model once to
    record them."""
    if example_inputs is not None:
        _record(model, example_inputs)
    rows = []
    for name, m in model.named_modules():
        layer = m.__dict__.get(ATTR)
        if layer is None:
            continue
        kernel = None if layer.plan is None else layer.plan.split(" ")[0] + (" (tuned)" if layer.tuned else "")
        rows.append({"name": name or type(m).__name__,
                     "input": None if layer.input is None else tuple(layer.input.shape), "kernel": kernel,
                     "plan": layer.plan, "tuned": layer.tuned, "bn": layer.bn,
                     "fused": "; ".join(dict.fromkeys(layer.fused)) or None,
                     "epilogue_in_torch": layer.epilogue_in_torch, "epilogue": layer.epilogue,
                     "fallback": layer.fallback,
                     "us": layer.us, "torch_us": layer.torch_us})
    return Report(rows)
