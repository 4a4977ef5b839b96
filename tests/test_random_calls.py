"""Compile tier: random calls through the whole public path on the CPU, against F.conv2d in float64.

Each call draws its argument forms as a caller might write them (ints, pairs, lists, numpy
integers, 'same' and 'valid'), its groups, kernel, stride, dilation and sizes, a dtype, and the
layouts of its tensors (channels_last, permuted, sliced, expanded, offset views, unbatched). The
CPU family computes them all, so what this walks is the layer every family shares: validation,
planning, the output's format, the launch arguments. A longer walk of this kind (650 calls) found
a freed bias copy being read (strided and expanded biases) and output formats that differed from
F.conv2d's on ambiguous tensors (one channel, or 1 x 1 planes, permuted); the 48 calls here keep
its kinds of call, and the last test pins the format rule itself.

The reference is F.conv2d in float64 only: torch's own CPU float16 convolution crashed (torch
2.13) on one of these calls, a channels_last view of one channel.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

import kernelgen
from kernelgen.checks import is_channels_last

pytestmark = pytest.mark.compile

SEED = 20261127
CALLS = 48


def _draw(rng: random.Random) -> dict:
    g = rng.choice([1, 1, 1, 2, 3, 4])
    C, K = g * rng.randint(1, 5), g * rng.randint(1, 4)
    kh, kw = rng.randint(1, 5), rng.randint(1, 5)
    sh, sw = rng.choice([1, 1, 2, 3]), rng.choice([1, 1, 2, 3])
    dh, dw = rng.choice([1, 1, 2, 3]), rng.choice([1, 1, 2])
    ph, pw = rng.randint(0, 3), rng.randint(0, 3)
    form = rng.choice(["int", "pair", "list", "same", "valid", "numpy"])
    if form == "same" and (sh, sw) != (1, 1):
        form = "pair"
    padding = {"int": ph, "pair": (ph, pw), "list": [ph, pw], "same": "same", "valid": "valid",
               "numpy": ("numpy", ph, pw)}[form]
    pads = (0, 0) if form in ("same", "valid") else (ph, ph) if form == "int" else (ph, pw)
    H = max(1, dh * (kh - 1) + 1 - 2 * pads[0] + rng.randint(0, 6))
    W = max(1, dw * (kw - 1) + 1 - 2 * pads[1] + rng.randint(0, 6))
    stride = (sh, sw) if rng.random() < 0.5 else [sh, sw]
    if sh == sw and rng.random() < 0.3:
        stride = sh
    return dict(N=rng.choice([1, 2, 3]), C=C, K=K, H=H, W=W, kernel=(kh, kw), stride=stride,
                padding=padding, dilation=(dh, dw) if (dh, dw) != (1, 1) else rng.choice([1, (1, 1), [1]]),
                groups=g, numpy_groups=rng.random() < 0.2, unbatched=rng.random() < 0.1,
                dtype=rng.choice([torch.float32] * 5 + [torch.float64, torch.bfloat16, torch.float16]),
                x=rng.choice(["dense", "dense", "channels_last", "permuted", "sliced", "expanded", "offset",
                              "transposed"]),
                w=rng.choice(["dense", "dense", "channels_last", "sliced", "expanded"]),
                b=rng.choice([None, "dense", "dense", "sliced", "expanded"]))


def _tensors(c: dict, gen: torch.Generator):
    N, C, H, W, K = c["N"], c["C"], c["H"], c["W"], c["K"]
    kh, kw = c["kernel"]

    def r(*shape):
        return torch.randn(*shape, generator=gen).to(c["dtype"])

    x = {"dense": lambda: r(N, C, H, W),
         "channels_last": lambda: r(N, C, H, W).contiguous(memory_format=torch.channels_last),
         "permuted": lambda: r(N, H, W, C).permute(0, 3, 1, 2),
         "sliced": lambda: r(N, C, 2 * H, W + 3)[:, :, ::2, 1:W + 1],
         "expanded": lambda: r(1, C, H, W).expand(N, C, H, W),
         "offset": lambda: r(N + 1, C, H, W)[1:],
         "transposed": lambda: r(N, C, W, H).transpose(2, 3)}[c["x"]]()
    if c["unbatched"]:
        x = x[0]
    cg = C // c["groups"]
    w = {"dense": lambda: r(K, cg, kh, kw),
         "channels_last": lambda: r(K, cg, kh, kw).contiguous(memory_format=torch.channels_last),
         "sliced": lambda: r(2 * K, cg, kh, kw)[::2],
         "expanded": lambda: r(1, cg, kh, kw).expand(K, cg, kh, kw)}[c["w"]]()
    b = {None: lambda: None, "dense": lambda: r(K), "sliced": lambda: r(3 * K)[1::3],
         "expanded": lambda: r(1).expand(K)}[c["b"]]()
    return x, w, b


def _kwargs(c: dict) -> dict:
    padding, groups = c["padding"], c["groups"]
    if c["numpy_groups"] or isinstance(padding, tuple) and padding[0] == "numpy":
        np = pytest.importorskip("numpy")
        groups = np.int64(groups) if c["numpy_groups"] else groups
        if isinstance(padding, tuple) and padding[0] == "numpy":
            padding = (np.int64(padding[1]), padding[2])
    return dict(stride=c["stride"], padding=padding, dilation=c["dilation"], groups=groups)


def _calls() -> list[dict]:
    rng = random.Random(SEED)
    return [_draw(rng) for _ in range(CALLS)]


@pytest.mark.parametrize("i", range(CALLS))
def test_random_call_matches_f_conv2d(i):
    c = _calls()[i]
    x, w, b = _tensors(c, torch.Generator().manual_seed(SEED + i))
    kw = _kwargs(c)
    ref = F.conv2d(x.double(), w.double(), None if b is None else b.double(), **kw)
    y = kernelgen.conv2d(x, w, b, **kw)
    assert y.shape == ref.shape and y.dtype == x.dtype, c
    if y.dim() == 4:  # the float64 copies keep the tensors' suggested formats, so ref's is F.conv2d's
        assert is_channels_last(y) == is_channels_last(ref), (c, y.stride(), ref.stride())
    tol = {torch.float64: 1e-12, torch.float32: 1e-5}.get(x.dtype) or torch.finfo(x.dtype).eps  # one rounding
    err = ((y.double() - ref).norm() / ref.norm().clamp_min(1e-300)).item()
    assert err <= tol, (c, err)
    assert torch.equal(kernelgen.conv2d(x, w, b, **kw), y), c  # again, through the plan


def test_is_channels_last_reads_strides_as_torch_does():
    # torch's own rule (Tensor.suggest_memory_format) decides F.conv2d's output format; its
    # Python twin in torch._prims_common is the oracle where this torch has it.
    pc = pytest.importorskip("torch._prims_common")
    if not hasattr(pc, "suggest_memory_format"):
        pytest.skip("this torch has no Python suggest_memory_format")
    rng = random.Random(SEED)
    for _ in range(3000):
        shape = [rng.choice([0, 1, 1, 2, 3, 5]) for _ in range(4)]
        perm = rng.sample(range(4), 4)
        if rng.random() < 0.7:
            base = torch.empty([shape[p] for p in perm])
        else:
            base = torch.empty([2 * shape[p] for p in perm])[::2, ::2, ::2, ::2]
        t = base.permute([perm.index(d) for d in range(4)])
        if rng.random() < 0.2:
            t = t.expand(*[3 if s == 1 and rng.random() < 0.5 else s for s in t.shape])
        assert is_channels_last(t) == (pc.suggest_memory_format(t) == torch.channels_last), (t.shape, t.stride())
