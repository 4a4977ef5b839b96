"""kernelgen.conv2d through autograd on the GPU (issue 56): gradients from kernelgen's own kernels
against float64 per docs/performance.md's accuracy rules (no worse than 1.5x cuDNN's own error in the same
precision), bit-identical across runs (no family reduces with atomics), and a few training steps of a
small converted network beside torch's."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import kernelgen

pytestmark = pytest.mark.gpu

# input (NCHW), weight, conv arguments: dense, strided (the input gradient by phases), 1x1,
# depthwise, grouped, dilated and 'same', first-layer-like, a batch of 32
LAYERS = [
    ((4, 32, 14, 14), (64, 32, 3, 3), dict(padding=1)),
    ((4, 32, 15, 15), (64, 32, 3, 3), dict(stride=2, padding=1)),
    ((8, 64, 7, 7), (128, 64, 1, 1), {}),
    ((2, 48, 20, 20), (48, 1, 3, 3), dict(padding=1, groups=48)),
    ((2, 32, 12, 12), (64, 8, 3, 3), dict(padding=1, groups=4)),
    ((2, 16, 17, 13), (24, 16, 3, 3), dict(padding="same", dilation=2)),
    ((2, 3, 32, 32), (16, 3, 7, 7), dict(stride=2, padding=3)),
    # batch 32: the weight gradient's convolution is reduction-bound (TF32: nhwc_tma, 16 splits)
    ((32, 32, 16, 16), (32, 32, 3, 3), dict(padding=1)),
]
IDS = ["dense", "stride2", "1x1", "depthwise", "grouped", "same-dil2", "stem", "batch32"]
CELLS = {"fp32": (torch.float32, False), "tf32": (torch.float32, True), "bf16-cl": (torch.bfloat16, None)}


def _grads(fn, x, w, b, seed_grad):
    xs, ws, bs = (t.detach().requires_grad_() for t in (x, w, b))
    y = fn(xs, ws, bs)
    y.backward(seed_grad.to(y.dtype))
    return xs.grad, ws.grad, bs.grad


def _rel(a, ref):
    return float((a.double() - ref).norm() / ref.norm())


def _case(xshape, wshape, kw, dtype, channels_last):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(xshape, device="cuda", generator=g).to(dtype)
    w = (torch.randn(wshape, device="cuda", generator=g) / (wshape[1] * wshape[2] * wshape[3]) ** 0.5).to(dtype)
    b = torch.randn(wshape[0], device="cuda", generator=g).to(dtype)
    if channels_last:
        x, w = x.contiguous(memory_format=torch.channels_last), w.contiguous(memory_format=torch.channels_last)
    y = F.conv2d(x.double(), w.double(), b.double(), **kw)
    seed_grad = torch.randn(y.shape, device="cuda", generator=g, dtype=torch.float64)
    return x, w, b, seed_grad


@pytest.mark.parametrize("cell", CELLS)
@pytest.mark.parametrize("xshape,wshape,kw", LAYERS, ids=IDS)
def test_gradients_within_cudnns_error(xshape, wshape, kw, cell):
    dtype, tf32 = CELLS[cell]
    x, w, b, seed_grad = _case(xshape, wshape, kw, dtype, channels_last=tf32 is None)
    ref = _grads(lambda *t: F.conv2d(*t, **kw), x.double(), w.double(), b.double(), seed_grad)
    prev = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = bool(tf32)
    try:
        theirs = _grads(lambda *t: F.conv2d(*t, **kw), x, w, b, seed_grad)
        ours = _grads(lambda *t: kernelgen.conv2d(*t, **kw), x, w, b, seed_grad)
    finally:
        torch.backends.cudnn.allow_tf32 = prev
    floor = 1e-5 if dtype == torch.float32 and not tf32 else 1e-3 if tf32 else 1e-4
    for name, got, want, base in zip(("input", "weight", "bias"), ours, ref, theirs):
        assert got.shape == want.shape and got.dtype == dtype, name
        assert torch.isfinite(got).all(), name
        err, bound = _rel(got, want), max(1.5 * _rel(base, want), floor)
        assert err <= bound, f"{name} gradient: relative error {err:.3g} > {bound:.3g}"


@pytest.mark.parametrize("xshape,wshape,kw", LAYERS[:4], ids=IDS[:4])
def test_gradients_are_bit_identical_under_deterministic_algorithms(xshape, wshape, kw):
    x, w, b, seed_grad = _case(xshape, wshape, kw, torch.float32, channels_last=False)
    prev = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        runs = [_grads(lambda *t: kernelgen.conv2d(*t, **kw), x, w, b, seed_grad) for _ in range(3)]
    finally:
        torch.use_deterministic_algorithms(prev)
    for other in runs[1:]:
        for a, c in zip(runs[0], other):
            assert torch.equal(a, c)


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
                                  nn.Conv2d(32, 64, 3, stride=2, padding=1), nn.BatchNorm2d(64), nn.ReLU(),
                                  nn.Conv2d(64, 64, 3, padding=1, groups=64), nn.Conv2d(64, 10, 1))

    def forward(self, x):
        return self.body(x).mean((2, 3))


def test_training_steps_follow_torchs():
    torch.manual_seed(0)
    ref = _Net().cuda().double()
    ours = kernelgen.convert(copy.deepcopy(ref))
    x = torch.randn(8, 3, 24, 24, device="cuda", dtype=torch.float64)
    target = torch.randint(0, 10, (8,), device="cuda")
    losses = []
    for model in (ref, ours):
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        curve = []
        for _ in range(4):
            opt.zero_grad()
            loss = F.cross_entropy(model(x), target)
            loss.backward()
            opt.step()
            curve.append(loss.item())
        losses.append(curve)
    assert losses[0] == pytest.approx(losses[1], rel=1e-9)
