"""A convolution's gradients, computed by kernelgen's own forward kernels (issue 56, first piece).

    grad_input  = input_grad(grad_out, weight, input.shape, stride, padding, dilation, groups)
    grad_weight = weight_grad(grad_out, input, weight.shape, stride, padding, dilation, groups)
    grad_bias   = bias_grad(grad_out)

Each gradient of y = F.conv2d(x, w, b, stride, padding, dilation, groups) is rewritten as FORWARD
convolutions run through `kernelgen.conv2d`, so every forward family, the selector, the tuner, the
cache and `precision` serve them unchanged; no torch convolution (F.conv2d, conv_transpose,
torch.nn.grad, aten.convolution_backward) runs here. Arguments take F.conv2d's forms: ints or
pairs, padding 'same'/'valid' (resolved as F.conv2d resolves them, an even kernel's extra pad at
the bottom/right), batched (N, C, H, W) or unbatched (C, H, W) tensors, any strides and float dtype.

Techniques, one spatial dimension at a time (stride s, dilation d, kernel k, pads pt before and
pb after, input length H, output length P):

- Input gradient: dx[i] = sum over (p, r) with p*s + r*d - pt = i of dy[p] * w[r]. With stride 1
  that is a forward convolution of dy with the kernel flipped spatially and transposed per group
  (each group's in/out channels swapped), dilation d, padding d*(k-1) - pt before and
  d*(k-1) - pb after; a negative pad crops dy instead. A strided gradient would be the same
  convolution over dy with s-1 zeros inserted between its rows, which wastes (s^2-1)/s^2 of the
  work on zeros, so it is decomposed by phase (sub-pixel): padded input rows u = i + pt with
  u % s == phi are touched only by the taps r with (r*d) % s == phi, an arithmetic progression of
  taps (step s/g, g = gcd(s, d)) whose rows sit d/g apart in u // s. Each of the s_h*s_w phases is
  one stride-1 forward convolution of dy with that flipped, transposed sub-kernel (dilation d/g),
  written into every s-th row/column of grad_input. A phase with no taps (s and d sharing a
  factor, or s > d*(k-1)+1) is zero, as are input rows no output reads (where
  (H + pt + pb - d*(k-1) - 1) % s != 0, or padding past the kernel): both come from the zero
  grad_input the phases are written into, or from dy's zero padding.
- Weight gradient: dW[o, c, r, t] = sum over n, p, q of dY[n, o, p, q] * Xpad[n, g*Cg + c,
  p*sh + r*dh, q*sw + t*dw] (g the group of o), a forward convolution with batch and channels
  swapped: input' = x as (Cg, G*N, H, W), weight' = dY as (O, N, P, Q), groups=G, stride=dilation,
  dilation=stride, padding=padding; it gives (Cg, O, KH, KW), returned as (O, Cg, KH, KW). The
  padding after the input is trimmed to what the last tap reads ((P-1)*s + (k-1)*d + 1 rows in
  all), so the convolution computes exactly k taps and no cropped extras; this also absorbs
  'same''s asymmetric pad and rows no output reads. The reduction over N*P*Q is the kernel's
  own accumulation (float32 for float16/bfloat16, float64 for float64); where it is long and the
  outputs few, the selector runs it on `wgrad`, which splits it between blocks and adds the
  splits' sums in a fixed order (docs/families.md).
- Bias gradient: a sum of grad_out over batch and pixels (torch.sum; float32 accumulation for
  float16/bfloat16, as the kernels accumulate).

Torch ops used besides kernelgen.conv2d, all data movement or that one reduction:
- views (unflatten, transpose, permute, narrow, slicing) and reshape, to present x, dY and the
  weight in the forward's layouts (a reshape copies only where groups > 1 makes it necessary);
- flip and strided slicing of the weight, to build the (sub-)kernels (the weight is small);
- narrow of grad_out or the input where a pad is negative (rows that no tap reaches);
- torch.nn.functional.pad where one side needs more zero padding than the other (conv2d's pads
  are symmetric): the phases' dy, and the weight gradient's input under 'same' with an even
  kernel or a trimmed end; a copy of that operand, far cheaper than computing cropped taps;
- torch.zeros and strided slice assignment, to interleave the phases into grad_input;
- torch.sum for bias_grad.

Precision follows kernelgen.conv2d: `precision=None` follows torch's convolution TF32 setting
for float32, 'ieee' or 'tf32' force it; other dtypes are unaffected.

Outputs: grad_input has the input's shape (unbatched where it was), channels_last when grad_out
is; grad_weight is contiguous (O, Cg, KH, KW); grad_bias is (O,).

A fused epilogue, y = act(z), z = conv2d(x, w, b) + residual (`backward`): grad_z is torch's own
backward formula of the activation (aten's threshold_backward, hardtanh_backward, ...), so ties and
NaN go as torch's do; it then feeds the three gradients above, and is the residual's gradient.
Torch's formula reads y or z. Where y decides it exactly, the forward saves y (`from_output`):
relu (torch itself reads y), relu6 (y <= 0 or y >= 6 exactly where z is: a clamp to bounds the dtype
holds), sigmoid (torch reads y), leaky_relu with a slope >= 0 (y > 0 exactly where z > 0; torch's
in-place leaky_relu_ reads y under the same condition). Elsewhere backward recomputes z with one more
forward call (activation=None, the residual kept), from the input, weight, bias and residual the
forward saved: silu, gelu and hardswish (not functions of y), leaky_relu with a slope < 0 (y > 0
misses z > 0), and hardsigmoid: y = clamp(z + 3, 0, 6) / 6 rounds z + 3 first, so z one ulp below 3
gives y == 1 where torch's z < 3 passes the gradient (in float16/bfloat16, rounding y to the dtype
widens that band), while the layers that use it (squeeze-excitation gates, 1x1 on pooled features)
are the cheapest to recompute. LeakyReLU's slope is the float32 the kernels computed with.
"""

from __future__ import annotations

import struct

import torch
import torch.nn.functional as F

from .checks import groups_arg, slope_bits
from .errors import ConvArgumentError
from .functional import conv2d, transient_weights
from .spec import pair, resolve_padding

__all__ = ["input_grad", "weight_grad", "bias_grad", "activation_grad", "from_output", "backward"]


# Memos of what a call's shapes and parameters decide (its geometry; the input gradient's phases), so a
# training step's later backward calls only look them up. Keys hold plain ints, strings and tuples of
# ints alone (_memo_key); other arguments (lists, symbolic sizes under torch.compile) are worked out
# each call. Bounded: past _MEMO_MAX entries nothing more is kept.
_MEMO_MAX = 4096
_geometries: dict = {}
_phase_memo: dict = {}


def _plain(v) -> bool:
    c = v.__class__
    return c is int or c is str or (c is tuple and all(e.__class__ is int for e in v))


def _memo_key(input_shape, weight_shape, stride, padding, dilation, groups):
    """The geometry's memo key, or None where an argument is not plain (it is then worked out, and
    explained if wrong, every call)."""
    try:
        key = (tuple(input_shape), tuple(weight_shape), stride, padding, dilation, groups)
    except TypeError:
        return None
    return key if all(_plain(v) for v in key) else None


def _geometry(input_shape, weight_shape, stride, padding, dilation, groups):
    """(unbatched, (N, C, H, W), (O, Cg, KH, KW), (sh, sw), (top, bottom, left, right), (dh, dw),
    groups, (P, Q)) for a forward call with these shapes, validated as F.conv2d validates them
    (memoised for plain arguments: a valid key's geometry once, an invalid one raising each call)."""
    key = _memo_key(input_shape, weight_shape, stride, padding, dilation, groups)
    geometry = None if key is None else _geometries.get(key)
    if geometry is None:
        geometry = _work_out_geometry(input_shape, weight_shape, stride, padding, dilation, groups)
        if key is not None and len(_geometries) < _MEMO_MAX:
            _geometries[key] = geometry
    return geometry


def _work_out_geometry(input_shape, weight_shape, stride, padding, dilation, groups):
    input_shape, weight_shape = tuple(int(v) for v in input_shape), tuple(int(v) for v in weight_shape)
    if len(input_shape) not in (3, 4):
        raise ConvArgumentError(f"Expected 3D (unbatched) or 4D (batched) input to conv2d, but got input of size: "
                                f"{list(input_shape)}")
    if len(weight_shape) != 4:
        raise ConvArgumentError(f"Expected 4-dimensional weight, but got weight of size {list(weight_shape)}")
    unbatched = len(input_shape) == 3
    N, C, H, W = (1, *input_shape) if unbatched else input_shape
    O, Cg, KH, KW = weight_shape
    G = groups_arg(groups)
    if G <= 0 or O % G or Cg * G != C or Cg == 0 or O == 0:
        raise ConvArgumentError(f"Given groups={G}, weight of size {list(weight_shape)} does not fit input of size "
                                f"{list(input_shape)}: expected {Cg * G} input channels and out_channels divisible "
                                f"by groups")
    s, d = pair("stride", stride), pair("dilation", dilation)
    if min(*s, *d) <= 0:
        raise ConvArgumentError(f"stride and dilation must be positive, got stride={s}, dilation={d}")
    pads = resolve_padding(padding, (KH, KW), s, d)
    P = (H + pads[0] + pads[1] - d[0] * (KH - 1) - 1) // s[0] + 1
    Q = (W + pads[2] + pads[3] - d[1] * (KW - 1) - 1) // s[1] + 1
    if P <= 0 or Q <= 0:
        raise ConvArgumentError(f"Calculated padded input size per channel: ({H + pads[0] + pads[1]} x "
                                f"{W + pads[2] + pads[3]}). Kernel size: ({d[0] * (KH - 1) + 1} x "
                                f"{d[1] * (KW - 1) + 1}). Kernel size can't be greater than actual input size")
    return unbatched, (N, C, H, W), (O, Cg, KH, KW), s, pads, d, G, (P, Q)


def _batched_grad(grad_out: torch.Tensor, unbatched: bool, expected: tuple) -> torch.Tensor:
    """grad_out as 4-D, after checking it is the forward output's shape."""
    want = expected[1:] if unbatched else expected
    if not isinstance(grad_out, torch.Tensor) or tuple(grad_out.shape) != tuple(want):
        got = list(grad_out.shape) if isinstance(grad_out, torch.Tensor) else type(grad_out).__name__
        raise ConvArgumentError(f"grad_out must have the forward output's size {list(want)}, got {got}")
    if not grad_out.is_floating_point():
        raise ConvArgumentError(f"grad_out must be a floating tensor, got {grad_out.dtype}")
    return grad_out.unsqueeze(0) if unbatched else grad_out


def _conv(x, w, pads, stride, dilation, groups, precision):
    """kernelgen.conv2d(x, w) with per-side pads (top, bottom, left, right), each possibly
    negative (crop x) or unequal (conv2d's padding is symmetric: the extra goes in with F.pad).
    None where cropping leaves nothing to read (the result is then all zeros)."""
    sym = []
    extra = [0, 0, 0, 0]  # F.pad order: left, right, top, bottom
    for dim, (lo, hi), slot in ((2, pads[:2], 2), (3, pads[2:], 0)):
        size = x.shape[dim]
        start, stop = max(-lo, 0), size - max(-hi, 0)
        if stop <= start:
            return None
        if start or stop != size:
            x = x.narrow(dim, start, stop - start)
        lo, hi = max(lo, 0), max(hi, 0)
        sym.append(min(lo, hi))
        extra[slot], extra[slot + 1] = lo - sym[-1], hi - sym[-1]
    if any(extra):
        x = F.pad(x, extra)
    with transient_weights():  # (w is this call's own: a flipped weight, or grad_out)
        return conv2d(x, w, None, stride, tuple(sym), dilation, groups, precision=precision)


def _phase(phi: int, k: int, s: int, d: int, pt: int, H: int, P: int):
    """One dimension of one input-gradient phase: padded input rows u = s*m + phi, m_lo <= m <= m_hi.

    Returns None if the phase covers no input row, else (first, count, taps, dil, pad_lo, pad_hi):
    grad_input rows first, first + s, ... (count of them) are the stride-1 convolution of dy,
    padded by (pad_lo, pad_hi), with the kernel taps `taps` (a slice of the kernel dimension,
    applied reversed) at dilation `dil`; taps is None where no tap lands on this phase (zeros).
    """
    m_lo = -((phi - pt) // s)  # ceil((pt - phi) / s): the first m whose row is inside the input
    m_hi = (pt + H - 1 - phi) // s
    count = m_hi - m_lo + 1
    if count <= 0:
        return None
    first = s * m_lo + phi - pt
    taps = [r for r in range(k) if (r * d) % s == phi]
    if not taps:
        return first, count, None, 1, 0, 0
    # tap r reads dy[m - t_r], t_r = (r*d - phi) / s; as a correlation over dy with the taps
    # reversed (j' = J-1-j), output m reads dy[m + j'*dil - (t_last)], so pad_lo = t_last - m_lo
    t = [(r * d - phi) // s for r in taps]
    dil = t[1] - t[0] if len(t) > 1 else 1
    step = taps[1] - taps[0] if len(taps) > 1 else 1
    pad_lo = t[-1] - m_lo
    pad_hi = count - P - pad_lo + dil * (len(taps) - 1)
    return first, count, slice(taps[0], taps[-1] + 1, step), dil, pad_lo, pad_hi


def _phases(KH, KW, s, d, pads, H, W, P, Q) -> tuple:
    """The input gradient's phases along the rows and along the columns (_phase), memoised."""
    key = (KH, KW, s, d, pads, H, W, P, Q)
    phases = _phase_memo.get(key)
    if phases is None:
        phases = (tuple(_phase(phi, KH, s[0], d[0], pads[0], H, P) for phi in range(s[0])),
                  tuple(_phase(phi, KW, s[1], d[1], pads[2], W, Q) for phi in range(s[1])))
        if len(_phase_memo) < _MEMO_MAX:
            _phase_memo[key] = phases
    return phases


def _flipped(w: torch.Tensor) -> torch.Tensor:
    """w with its kernel reversed along rows and columns: a copy along the dimensions longer than
    one tap, the view itself where neither is (a 1x1 kernel's flip is itself: no copy, no launch)."""
    dims = [d for d in (2, 3) if w.shape[d] > 1]
    return w.flip(dims) if dims else w


def input_grad(grad_out: torch.Tensor, weight: torch.Tensor, input_shape, stride=1, padding=0, dilation=1,
               groups: int = 1, *, precision: str | None = None) -> torch.Tensor:
    """The gradient of F.conv2d(input, weight, ...) with respect to its input, given grad_out
    (the gradient of its output) and the input's shape; computed by kernelgen's forward kernels
    (stride 1: one convolution with the flipped, per-group transposed weight; stride s: one per
    phase, s_h*s_w of them, none of them on inserted zeros; see the module's docstring).

    grad_out: (N, O, P, Q), or (O, P, Q) where input_shape is unbatched (C, H, W); any strides.
    weight: (O, C/groups, KH, KW), grad_out's dtype and device.
    Returns grad_input of input_shape, grad_out's dtype, channels_last when grad_out is.
    """
    unbatched, (N, C, H, W), (O, Cg, KH, KW), s, pads, d, G, (P, Q) = _geometry(
        input_shape, weight.shape, stride, padding, dilation, groups)
    dy = _batched_grad(grad_out, unbatched, (N, O, P, Q))
    if weight.dtype != dy.dtype or weight.device != dy.device:
        raise ConvArgumentError(f"weight ({weight.dtype}, {weight.device}) and grad_out ({dy.dtype}, {dy.device}) "
                                f"must share dtype and device")
    fmt = torch.channels_last if (not unbatched and dy.dim() == 4 and dy.is_contiguous(
        memory_format=torch.channels_last) and not dy.is_contiguous()) else torch.contiguous_format
    # per group, swap in and out channels: (G*Og, Cg, .) -> (G*Cg, Og, .)
    Og = O // G
    wt = weight.transpose(0, 1) if G == 1 else weight.unflatten(0, (G, Og)).transpose(1, 2).reshape(C, Og, KH, KW)
    phases_h, phases_w = _phases(KH, KW, s, d, pads, H, W, P, Q)
    dx = None
    if s == (1, 1) and phases_h[0][2] is not None and phases_w[0][2] is not None:
        # one phase covering every input row: the convolution's output is grad_input itself
        _, _, th, dil_h, lo_h, hi_h = phases_h[0]
        _, _, tw, dil_w, lo_w, hi_w = phases_w[0]
        dx = _conv(dy, _flipped(wt), (lo_h, hi_h, lo_w, hi_w), 1, (dil_h, dil_w), G, precision)
        if dx is not None and fmt is torch.channels_last:
            dx = dx.contiguous(memory_format=fmt)
    if dx is None:
        dx = torch.zeros((N, C, H, W), dtype=dy.dtype, device=dy.device).contiguous(memory_format=fmt)
        for ph in phases_h:
            for pw in phases_w:
                if ph is None or pw is None or ph[2] is None or pw[2] is None:
                    continue  # no input row, or no tap: zero gradient
                fh, nh, th, dil_h, lo_h, hi_h = ph
                fw, nw, tw, dil_w, lo_w, hi_w = pw
                part = _conv(dy, _flipped(wt[:, :, th, tw]), (lo_h, hi_h, lo_w, hi_w), 1, (dil_h, dil_w), G,
                             precision)
                if part is not None:
                    dx[:, :, fh::s[0], fw::s[1]] = part
    return dx.squeeze(0) if unbatched else dx


def weight_grad(grad_out: torch.Tensor, input: torch.Tensor, weight_shape, stride=1, padding=0, dilation=1,
                groups: int = 1, *, precision: str | None = None) -> torch.Tensor:
    """The gradient of F.conv2d(input, weight, ...) with respect to its weight, given grad_out
    and the forward's input; computed by one kernelgen forward convolution with batch and channels
    swapped (stride and dilation trade places; see the module's docstring).

    grad_out: (N, O, P, Q), or (O, P, Q) for an unbatched (C, H, W) input; any strides.
    input: the forward's input, grad_out's dtype and device. weight_shape: (O, C/groups, KH, KW).
    Returns grad_weight of weight_shape, contiguous, grad_out's dtype.
    """
    if not isinstance(input, torch.Tensor):
        raise ConvArgumentError(f"input must be a tensor, got {type(input).__name__}")
    unbatched, (N, C, H, W), (O, Cg, KH, KW), s, pads, d, G, (P, Q) = _geometry(
        input.shape, weight_shape, stride, padding, dilation, groups)
    dy = _batched_grad(grad_out, unbatched, (N, O, P, Q))
    if input.dtype != dy.dtype or input.device != dy.device:
        raise ConvArgumentError(f"input ({input.dtype}, {input.device}) and grad_out ({dy.dtype}, {dy.device}) "
                                f"must share dtype and device")
    if N == 0:
        return torch.zeros((O, Cg, KH, KW), dtype=dy.dtype, device=dy.device)
    x = input.unsqueeze(0) if unbatched else input
    if G > 1 and N > 1 and not x.is_contiguous() and x.is_contiguous(memory_format=torch.channels_last):
        # input' below is a copy: from channels_last, make x NCHW first. That transpose reads one
        # image at a time (its pixels' channels together), and the copy below then moves whole planes.
        # Copied at once, input''s order (group, image, pixel) revisits every pixel's channels once a
        # group, far apart: 28 ms for case 84's 2 GB on an H200 (benchmarks/results/h200_backward_profile.md).
        x = x.contiguous()
    # input' (Cg, G*N, H, W): channel g*N + n is image n's channel g*Cg + c (a view when G == 1)
    xs = x.transpose(0, 1) if G == 1 else x.unflatten(1, (G, Cg)).permute(2, 1, 0, 3, 4).reshape(Cg, G * N, H, W)
    # weight' (O, N, P, Q): always a view
    ws = dy.transpose(0, 1)
    # pad after the input only as far as the last tap reads: the convolution then has exactly KH x KW outputs
    bottom = (P - 1) * s[0] + (KH - 1) * d[0] + 1 - H - pads[0]
    right = (Q - 1) * s[1] + (KW - 1) * d[1] + 1 - W - pads[2]
    dw = _conv(xs, ws, (pads[0], bottom, pads[2], right), d, s, G, precision)
    if dw is None:  # every tap reads only padding (a stride past the input, say): zero gradient
        return torch.zeros((O, Cg, KH, KW), dtype=dy.dtype, device=dy.device)
    return dw.transpose(0, 1).contiguous()


def bias_grad(grad_out: torch.Tensor) -> torch.Tensor:
    """The gradient of F.conv2d(..., bias) with respect to its bias: grad_out summed over batch and
    pixels, (O,) for a batched (N, O, P, Q) or unbatched (O, P, Q) grad_out. float16/bfloat16
    accumulate in float32 and round once, as the kernels do."""
    if not isinstance(grad_out, torch.Tensor) or grad_out.dim() not in (3, 4):
        raise ConvArgumentError("grad_out must be a 3-D (unbatched) or 4-D (batched) tensor")
    dims = (1, 2) if grad_out.dim() == 3 else (0, 2, 3)
    if grad_out.dtype in (torch.float16, torch.bfloat16):
        return grad_out.sum(dims, dtype=torch.float32).to(grad_out.dtype)
    return grad_out.sum(dims)


_aten = torch.ops.aten
# kernelgen.ACTIVATIONS' derivatives as torch's autograd computes them, (grad, saved, slope) -> grad_z:
# `saved` is the call's output y where from_output() says so (relu, relu6, sigmoid, leaky_relu with a
# slope >= 0), else the pre-activation z. Ties and NaN are torch's: relu's gradient at 0 is 0, relu6's
# (hardtanh's) passes only strictly inside (0, 6), hardsigmoid's strictly inside (-3, 3).
_ACTIVATION_GRADS = {
    "relu": lambda g, y, slope: _aten.threshold_backward(g, y, 0),
    "relu6": lambda g, y, slope: _aten.hardtanh_backward(g, y, 0, 6),
    "sigmoid": lambda g, y, slope: _aten.sigmoid_backward(g, y),
    "leaky_relu": lambda g, s, slope: _aten.leaky_relu_backward(g, s, slope, slope >= 0),
    "silu": lambda g, z, slope: _aten.silu_backward(g, z),
    "gelu": lambda g, z, slope: _aten.gelu_backward(g, z),
    "hardswish": lambda g, z, slope: _aten.hardswish_backward(g, z),
    "hardsigmoid": lambda g, z, slope: _aten.hardsigmoid_backward(g, z),
}
_FROM_OUTPUT = frozenset({"relu", "relu6", "sigmoid"})


def _kernel_slope(negative_slope) -> float:
    """LeakyReLU's slope as the kernels computed with it: the nearest float32."""
    return struct.unpack("<f", struct.pack("<I", slope_bits(negative_slope)))[0]


def from_output(activation: str | None, negative_slope=0.01) -> bool:
    """Whether backward through `activation` reads the call's output y (which the forward then
    saves) rather than recomputing the pre-activation z (for which it saves bias and residual);
    see the module's docstring for why each activation is where it is."""
    if activation == "leaky_relu":
        return _kernel_slope(negative_slope) >= 0  # (-0.0 too: the kernel's y is then +-0 for z <= 0)
    return activation in _FROM_OUTPUT


def activation_grad(grad_out: torch.Tensor, activation: str, negative_slope, saved: torch.Tensor) -> torch.Tensor:
    """grad_out through `activation` by torch's own backward formula: the gradient of its input z.
    `saved` is the call's output y where from_output(activation, negative_slope), else z."""
    if activation not in _ACTIVATION_GRADS:
        from .checks import check_activation

        check_activation(activation)  # raises, naming the activations there are
    slope = _kernel_slope(negative_slope) if activation == "leaky_relu" else 0.0
    return _ACTIVATION_GRADS[activation](grad_out, saved, slope)


SCALE_HAS_NO_GRADIENT = ("kernelgen.conv2d: the scale gets no gradient; pass scale.detach() (a folded "
                         "BatchNorm's scale is a constant of inference)")


def to_save(activation: str | None, negative_slope, input, weight, output, bias, residual, scale) -> tuple:
    """What a call's autograd keeps for `backward` (the eager Function and the compiled operator
    alike): input and weight; with a scale or an activation, also (output, bias, residual, scale),
    each None where backward does not read it: the output where from_output(), else the bias and
    residual that recompute the pre-activation."""
    if activation is None:
        return (input, weight) if scale is None else (input, weight, None, None, None, scale)
    keep = from_output(activation, negative_slope)
    return input, weight, output if keep else None, None if keep else bias, None if keep else residual, scale


def _scaled(grad: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """grad[..., k, :, :] * scale[k]: computed in float32 (float64 for float64) as the forward's
    epilogue multiplies, rounded once to grad's dtype."""
    wide = torch.float64 if grad.dtype == torch.float64 else torch.float32
    return (grad.to(wide) * scale.to(wide)[:, None, None]).to(grad.dtype)


def backward(grad_out: torch.Tensor, input: torch.Tensor, weight: torch.Tensor, needs, stride, padding, dilation,
             groups: int, precision: str | None = None, activation: str | None = None, negative_slope=0.01, *,
             output: torch.Tensor | None = None, bias: torch.Tensor | None = None,
             residual: torch.Tensor | None = None, family: str | None = None, tiles=None,
             scale: torch.Tensor | None = None) -> tuple:
    """(grad_input, grad_weight, grad_bias, grad_residual) of a kernelgen.conv2d call, each None where
    `needs` (four bools: input, weight, bias, residual, as autograd's needs_input_grad) says it is not
    wanted: what the call's autograd (eager and the compiled operator's) runs.

    With a fused activation, grad_out first goes through the activation's derivative (torch's
    formula), read from `output` (the call's y) where from_output(activation, negative_slope), else
    from z = conv2d(input, weight, bias, ..., residual=residual), recomputed here by one forward call
    (the call's precision, family and tiles; activation=None). grad_z then feeds the convolution's
    gradients and is the residual's gradient (without an activation: grad_out itself). With an
    epilogue `scale` (z = scale[k] * conv2d(input, weight)[k] + bias[k] + residual), the bias and
    residual take grad_z, input and weight the convolution's gradients of grad_z * scale[k] (in
    float32, float64 for float64, rounded once to grad_z's dtype); the scale gets none. Double
    backward raises NotImplementedError."""
    if torch.is_grad_enabled():
        raise NotImplementedError("kernelgen.conv2d: double backward (create_graph=True) is not supported; its "
                                  "gradients are computed without a graph of their own")
    need_input, need_weight, need_bias, need_residual = (bool(n) for n in needs)
    if activation is not None and (need_input or need_weight or need_bias or need_residual):
        if from_output(activation, negative_slope):
            if output is None:
                raise ConvArgumentError(f"backward through {activation!r} reads the forward's output: pass output=")
            saved = output
        else:  # the pre-activation, as the forward's kernel computed it before its activation
            saved = conv2d(input, weight, bias, stride, padding, dilation, groups, precision=precision, family=family,
                           tiles=tiles, residual=residual, scale=scale)
        grad_out = activation_grad(grad_out, activation, negative_slope, saved)
    grad_conv = grad_out
    if scale is not None and (need_input or need_weight):
        grad_conv = _scaled(grad_out, scale)
    return (input_grad(grad_conv, weight, input.shape, stride, padding, dilation, groups, precision=precision)
            if need_input else None,
            weight_grad(grad_conv, input, weight.shape, stride, padding, dilation, groups, precision=precision)
            if need_weight else None,
            bias_grad(grad_out) if need_bias else None,
            grad_out if need_residual else None)
