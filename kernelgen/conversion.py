"""A whole model's convolutions on kernelgen: `convert`, `revert`, `report` (issue 53).

    model = kernelgen.convert(model, example_inputs=(x,))   # in place; returns the model
    print(kernelgen.report(model))                          # per layer: input, kernel, µs vs F.conv2d
    kernelgen.revert(model)                                 # back to torch's convolution

A layer is converted by changing its class in place (`module.__class__`), not by building a new
module: the object stays the same, so its Parameters, buffers, hooks, training flag, device, dtype,
`state_dict` keys, and every reference to it (a parent, a layer shared by two parents, an
optimizer's parameter list) are untouched. Each converted layer carries `kernelgen_layer`, a
`Layer` record of what convert did to it; `revert` and `report` read it.

The module is `conversion`, not `convert`: importing a submodule sets it as an attribute of its
package, so a `kernelgen/convert.py` imported before `kernelgen.convert` was first looked up would
leave `kernelgen.convert` a module rather than the function.

Not here yet (issue 53's other parts, which need template and GPU work): epilogue fusion (ReLU,
SiLU, residual add in the kernels) and weights packed once per weight version.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import Counter
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .functional import conv2d
from .kernels import count
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
    recorded call (convert's or report's example inputs), or None. plan: the kernel kernelgen runs
    for that call (ConvSpec.summary()); tuned: whether it was measured on this device.
    us, torch_us: kernelgen's and F.conv2d's time for that call in microseconds, where measured.
    """

    original: type
    bn: str | None = None
    fallback: str | None = None
    input: torch.Tensor | None = None
    plan: str | None = None
    tuned: bool = False
    us: float | None = None
    torch_us: float | None = None
    added_precision: bool = False  # convert set `precision`, which revert then removes


def convert(model: nn.Module, example_inputs: Any = None, *, fold_bn: bool = False, tune: bool = False,
            fallback: str | None = None) -> nn.Module:
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
    tune: measure each recorded call's candidates on this device (kernelgen.tune_calls) and keep
        the fastest; needs example_inputs.
    fallback: None, or 'torch': a layer whose kernelgen kernel (tuned, where `tune`) is slower
        than F.conv2d on the example inputs keeps torch's convolution; logged at INFO, counted
        (kernelgen.stats()['convert_fallbacks']) and marked in the report. Needs example_inputs.
    """
    if fallback not in FALLBACKS:
        raise ValueError(f"fallback={fallback!r}: expected one of {FALLBACKS}")
    if (tune or fallback) and example_inputs is None:
        raise ValueError(f"{'tune=True' if tune else f'fallback={fallback!r}'} needs example_inputs: the layers "
                         "are measured on the calls the model makes on them")
    folded = fold_batchnorm(model) if fold_bn else {}
    for m in model.modules():
        target = _target_class(m)
        if target is not None:
            _swap(m, target)
        layer = getattr(m, ATTR, None)
        if m in folded and layer is not None:
            layer.bn = folded[m]
    if example_inputs is not None:
        calls = _record(model, example_inputs)
        if tune:
            _tune(calls)
        if tune or fallback:
            _measure(model, calls, fallback)
    return model


def revert(model: nn.Module) -> nn.Module:
    """Undo `convert` in place (returns `model`): every converted layer gets its original class
    back, and a kernelgen.Conv2d built directly becomes a torch.nn.Conv2d. Parameters, buffers
    and state_dict are kept, so outputs match the model before `convert` (a folded BatchNorm
    stays folded)."""
    for m in model.modules():
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
    return conv2d(input, weight, bias, self.stride, padding, self.dilation, self.groups, precision=self.precision)


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
    weight is updated in place (the same Parameter); a conv without bias gains one."""
    scale = torch.rsqrt(bn.running_var.double() + bn.eps)
    if bn.weight is not None:
        scale = scale * bn.weight.double()
    shift = -bn.running_mean.double() * scale
    if bn.bias is not None:
        shift = shift + bn.bias.double()
    w = conv.weight
    bias = shift if conv.bias is None else conv.bias.double() * scale + shift
    w.copy_(w.double() * scale.reshape(-1, 1, 1, 1))
    if conv.bias is None:
        conv.bias = nn.Parameter(bias.to(device=w.device, dtype=w.dtype), requires_grad=w.requires_grad)
    else:
        conv.bias.copy_(bias)


# --- recording, tuning, measuring -----------------------------------------------------------------

def _call(m: nn.Module, input, weight, bias, padding) -> dict:
    # detached: the tuner turns errors into floats, and nothing here needs their graph
    return dict(input=input.detach(), weight=weight.detach(), bias=None if bias is None else bias.detach(),
                stride=m.stride, padding=padding, dilation=m.dilation, groups=m.groups, precision=m.precision)


def _pre_hook(m: nn.Module, args: tuple) -> None:
    x, padding = args[0], m.padding
    if m.padding_mode != "zeros":
        x, padding = F.pad(x, m._reversed_padding_repeated_twice, mode=m.padding_mode), 0
    _calls[m] = _call(m, x, m.weight, m.bias, padding)


def _record(model: nn.Module, example_inputs: Any) -> dict[nn.Module, dict]:
    """Run `model` once on `example_inputs` (eval mode, no_grad; the training flags restored
    after) and return each converted layer's call (its last, where it is called several times);
    each layer's Layer gets the call's input and plan."""
    global _calls
    args = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
    layers = [m for m in model.modules() if ATTR in m.__dict__]  # fallback layers too, for report
    modes = {m: m.training for m in model.modules()}
    handles = [m.register_forward_pre_hook(_pre_hook) for m in layers]
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
        layer.plan, layer.tuned = _plan_of(call)
    return calls


def _plan_of(call: dict) -> tuple[str | None, bool]:
    """(the kernel's summary, whether it was tuned) that kernelgen.conv2d serves for `call`: its
    plan record where there is one, else the selector's choice."""
    from . import functional, plans
    from .kernels import default_cache

    sig = functional.signature(**call, family=None, tiles=None)
    record = plans.read(default_cache().root, functional._record_name(sig, call["input"])) if sig else None
    if record and record.get("summary"):
        return record["summary"], isinstance(record.get("tuned"), dict)
    spec, _ = functional.spec_for(**call)
    return (spec.summary() if spec is not None else None), False


def _unique(calls: dict) -> dict[tuple, dict]:
    """One call per plan signature: layers of identical calls are tuned and timed once."""
    from . import functional

    out = {}
    for call in calls.values():
        out.setdefault(functional.signature(**call, family=None, tiles=None), call)
    return out


def _tune(calls: dict) -> None:
    from .tuner import tune_calls

    unique = list(_unique(calls).values())
    log.info("kernelgen.convert: tuning %d distinct convolution(s) of %d layer(s)", len(unique), len(calls))
    tune_calls(unique)
    for m, call in calls.items():
        getattr(m, ATTR).plan, getattr(m, ATTR).tuned = _plan_of(call)


def _time_call(call: dict) -> tuple[float, float]:
    """(kernelgen.conv2d's, F.conv2d's) microseconds for `call`, timed by the tuner's clock (CUDA
    events on a GPU, the host clock on the CPU), the two taking turns."""
    from . import tuner

    args = (call["input"], call["weight"], call["bias"], call["stride"], call["padding"], call["dilation"],
            call["groups"])
    with torch.no_grad():
        kg, th = tuner._stream_us([lambda: conv2d(*args, precision=call["precision"]), lambda: F.conv2d(*args)],
                                  cuda=call["input"].is_cuda)
    return kg, th


def _measure(model: nn.Module, calls: dict, fallback: str | None) -> None:
    from . import functional

    times = {sig: _time_call(call) for sig, call in _unique(calls).items()}
    names = {m: n for n, m in model.named_modules()}
    for m, call in calls.items():
        layer = getattr(m, ATTR)
        layer.us, layer.torch_us = times[functional.signature(**call, family=None, tiles=None)]
        if fallback == "torch" and layer.us > layer.torch_us:
            layer.fallback = "torch"
            m.__class__ = layer.original
            count("convert_fallbacks")
            log.info("kernelgen.convert: %s keeps torch's convolution: kernelgen %.1f us > F.conv2d %.1f us "
                     "(input %s, %s)", names.get(m, type(m).__name__), layer.us, layer.torch_us,
                     tuple(call["input"].shape), layer.plan)


# --- report ---------------------------------------------------------------------------------------

@dataclasses.dataclass
class Report:
    """`kernelgen.report`'s table: `rows`, one dict per converted layer, and `str()` to print."""

    rows: list[dict]

    COLUMNS = (("name", "layer"), ("input", "input"), ("kernel", "kernel"), ("bn", "bn folded"),
               ("fallback", "fallback"), ("us", "kernelgen µs"), ("torch_us", "F.conv2d µs"))

    def __str__(self) -> str:
        def cell(key, v):
            if v is None:
                return "-"
            if key == "input":
                return "x".join(map(str, v))
            if isinstance(v, float):
                return f"{v:.1f}"
            return str(v)

        table = [[head for _, head in self.COLUMNS]]
        table += [[cell(k, r[k]) for k, _ in self.COLUMNS] for r in self.rows]
        widths = [max(len(row[i]) for row in table) for i in range(len(self.COLUMNS))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in table]
        lines.insert(1, "  ".join("-" * w for w in widths))
        n_fb = sum(r["fallback"] is not None for r in self.rows)
        n_bn = sum(r["bn"] is not None for r in self.rows)
        lines.append(f"{len(self.rows)} layer(s): {len(self.rows) - n_fb} on kernelgen, {n_fb} on torch "
                     f"(fallback), {n_bn} with BatchNorm folded")
        return "\n".join(lines)


def report(model: nn.Module, example_inputs: Any = None) -> Report:
    """A table of `model`'s converted layers: qualified name, input shape, the kernel kernelgen runs
    (family[tiles]; `plan` in the rows has its whole summary, `tuned` whether it was measured),
    the BatchNorm folded in, fallback, and kernelgen's and F.conv2d's µs where convert measured
    them. Input and kernel are those of the last recorded call: `convert`'s example inputs, or
    `example_inputs` here, which runs the model once to record them."""
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
                     "plan": layer.plan, "tuned": layer.tuned, "bn": layer.bn, "fallback": layer.fallback,
                     "us": layer.us, "torch_us": layer.torch_us})
    return Report(rows)
