"""Compile tier: the CPU family through the whole pipeline, against F.conv2d in float64."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import kernelgen

pytestmark = pytest.mark.compile


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.double() - ref).norm() / ref.norm()).item()


def reference(x, w, b, **kw):
    return F.conv2d(x.double(), w.double(), None if b is None else b.double(), **kw)


CASES = [
    # (N, C, H, W), (K, kh, kw), kwargs
    ((2, 8, 17, 19), (16, 3, 5), dict(stride=(2, 1), padding=(1, 2), dilation=(1, 2), groups=2)),
    ((1, 3, 16, 16), (8, 3, 3), dict(padding=1)),
    ((2, 4, 15, 13), (6, 1, 1), dict()),
    ((2, 4, 15, 13), (6, 1, 1), dict(stride=2)),
    ((2, 6, 12, 20), (6, 3, 3), dict(groups=6, padding=1)),               # depthwise
    ((2, 4, 12, 20), (8, 3, 1), dict(groups=4)),                          # depthwise x2, k x 1
    ((2, 4, 11, 9), (4, 1, 3), dict(groups=4, padding=(0, 1))),           # 1 x k
    ((1, 4, 10, 10), (5, 4, 4), dict(padding="same")),                    # even kernel, 'same'
    ((1, 4, 10, 12), (5, 2, 3), dict(padding="same", dilation=(2, 3))),
    ((2, 4, 9, 9), (5, 3, 3), dict(padding="valid", stride=3)),
    ((3, 2, 7, 31), (3, 5, 7), dict(padding=(2, 3))),
    ((1, 2, 5, 5), (2, 5, 5), dict()),                                    # output 1 x 1
]


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("xshape,wshape,kw", CASES)
def test_matches_f_conv2d(xshape, wshape, kw, bias):
    g = kw.get("groups", 1)
    x = torch.randn(*xshape)
    w = torch.randn(wshape[0], xshape[1] // g, wshape[1], wshape[2])
    b = torch.randn(wshape[0]) if bias else None
    y = kernelgen.conv2d(x, w, b, **kw)
    ref = reference(x, w, b, **kw)
    assert y.shape == ref.shape and y.dtype == x.dtype
    assert rel_err(y, ref) <= 1e-5


@pytest.mark.parametrize("form", ["numpy", "tensor"])
def test_integer_like_parameters(form):
    # F.conv2d takes numpy integers and one-element integer tensors as ints, and so does kernelgen
    # (they once reached a plan record's JSON and failed there). The first case's spec: no new build.
    if form == "numpy":
        np = pytest.importorskip("numpy")
        i = np.int64
    else:
        i = lambda v: torch.tensor([v])  # noqa: E731
    x = torch.randn(2, 8, 17, 19)
    w = torch.randn(16, 4, 3, 5)
    kw = dict(stride=(i(2), 1), padding=(1, i(2)), dilation=[1, i(2)], groups=i(2))
    y = kernelgen.conv2d(x, w, **kw)
    assert rel_err(y, reference(x, w, None, stride=(2, 1), padding=(1, 2), dilation=(1, 2), groups=2)) <= 1e-5
    assert torch.equal(kernelgen.conv2d(x, w, **kw), y)  # the second call: planned (numpy) or not (tensor)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.float16])
def test_dtypes(dtype):
    x = torch.randn(2, 4, 13, 11)
    w = torch.randn(6, 2, 3, 3)
    b = torch.randn(6)
    kw = dict(padding=1, groups=2)
    y = kernelgen.conv2d(x.to(dtype), w.to(dtype), b.to(dtype), **kw)
    ref = reference(x.to(dtype), w.to(dtype), b.to(dtype), **kw)
    assert y.dtype == dtype
    if dtype == torch.float64:
        assert rel_err(y, ref) <= 1e-12
    else:
        torch_err = rel_err(F.conv2d(x.to(dtype), w.to(dtype), b.to(dtype), **kw), ref)
        assert rel_err(y, ref) <= max(1.5 * torch_err, 1e-3)


def test_unbatched_input():
    x = torch.randn(4, 9, 9)
    w = torch.randn(5, 4, 3, 3)
    y = kernelgen.conv2d(x, w, padding=1)
    assert y.shape == (5, 9, 9)
    assert rel_err(y, reference(x, w, None, padding=1)) <= 1e-5


def test_channels_last_and_non_contiguous_inputs():
    x = torch.randn(2, 8, 14, 14)
    w = torch.randn(6, 8, 3, 3)
    for xin, win in [(x.contiguous(memory_format=torch.channels_last), w),
                     (x, w.contiguous(memory_format=torch.channels_last)),
                     (torch.randn(2, 14, 14, 8).permute(0, 3, 1, 2), w),     # a permuted view
                     (torch.randn(2, 8, 28, 29)[:, :, ::2, 1::2], w),         # strided view
                     (torch.randn(1, 8, 1, 14).expand(2, 8, 14, 14), w)]:     # zero strides
        y = kernelgen.conv2d(xin, win, padding=1)
        ref = F.conv2d(xin, win, padding=1)
        assert rel_err(y, ref.double()) <= 1e-5
        assert y.is_contiguous(memory_format=torch.channels_last) == ref.is_contiguous(
            memory_format=torch.channels_last)
        assert y.is_contiguous() == ref.is_contiguous()


def _weight_views(shape):
    """The same weight values in five layouts: OIHW, channels_last, a slice, a permuted view
    and one broadcast along its output channels."""
    K, C, kh, kw = shape
    w = torch.randn(shape)
    big = torch.randn(2 * K, C, kh + 2, kw)
    big[::2, :, 1:kh + 1] = w
    perm = torch.empty(kh, kw, K, C)
    perm.copy_(w.permute(2, 3, 0, 1))
    one = torch.randn(1, C, kh, kw)
    return [("oihw", w), ("channels_last", w.contiguous(memory_format=torch.channels_last)),
            ("slice", big[::2, :, 1:kh + 1]), ("permuted", perm.permute(2, 3, 0, 1)),
            ("broadcast", one.expand(K, C, kh, kw))]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast_computes_in_the_region_dtype(dtype):
    # conv2d is one of autocast's lower-precision ops: F.conv2d casts its floating arguments (not
    # float64 ones) to the region's dtype, and so must a drop-in (it once computed float32, and
    # refused a bfloat16 activation with float32 weights)
    x, w, b = torch.randn(2, 4, 9, 9), torch.randn(6, 4, 3, 3), torch.randn(6)
    with torch.autocast("cpu", dtype=dtype):
        y = kernelgen.conv2d(x, w, b, padding=1)
        mixed = kernelgen.conv2d(x.to(dtype), w, b, padding=1)
        wide = kernelgen.conv2d(x.double(), w.double(), padding=1)
        assert F.conv2d(x, w, b, padding=1).dtype == dtype
    assert y.dtype == mixed.dtype == dtype and wide.dtype == torch.float64
    cast = kernelgen.conv2d(x.to(dtype), w.to(dtype), b.to(dtype), padding=1)
    assert torch.equal(y, cast) and torch.equal(mixed, cast)
    assert kernelgen.conv2d(x, w, b, padding=1).dtype == torch.float32  # outside the region


@pytest.mark.parametrize("kind", ["strided", "expanded"])
def test_bias_that_is_not_contiguous(kind):
    # Such a bias is copied to contiguous for the launch. The copy once was a temporary freed
    # before the launch, whose memory the host's heap (or the workspace, on CUDA) handed on:
    # the outputs were 1e13 off.
    x = torch.randn(2, 8, 14, 14)
    w = torch.randn(6, 8, 3, 3)
    b = torch.randn(12)[::2] if kind == "strided" else torch.randn(1).expand(6)
    for _ in range(3):  # the first call plans, the later ones run the plan
        y = kernelgen.conv2d(x, w, b, padding=1)
        assert rel_err(y, reference(x, w, b, padding=1)) <= 1e-5


@pytest.mark.parametrize("groups", [1, 2])
def test_weights_are_read_through_their_strides(groups):
    """Kernels read a weight where it lies (KgW): every layout gives F.conv2d's answer, and
    the plan passes the weight's own strides instead of copying it."""
    from kernelgen import functional

    x = torch.randn(2, 6, 11, 13)
    for name, w in _weight_views((4, 6 // groups, 3, 2)):
        y = kernelgen.conv2d(x, w, padding=(1, 0), groups=groups)
        ref = reference(x, w, None, padding=(1, 0), groups=groups)
        assert rel_err(y, ref) <= 1e-5, name
        plan = next(p for sig, p in functional._plans.items() if sig[5] == w.stride() and sig[4] == w.shape)
        assert plan.w_asis, name
        assert plan.args[-5:-1] == w.stride(), name


def test_weights_past_32_bit_offsets_are_copied():
    """A weight whose offsets do not fit 32 bits is handed over as a contiguous copy."""
    from kernelgen.functional import _weight_strides

    assert _weight_strides(torch.empty(8, 4, 3, 3, device="meta")) == (True, (36, 9, 3, 1))
    cl = torch.empty(8, 4, 3, 3, device="meta").contiguous(memory_format=torch.channels_last)
    assert _weight_strides(cl) == (True, (36, 1, 12, 4))
    far = torch.empty_strided((2, 4, 3, 3), (1 << 31, 9, 3, 1), device="meta")
    assert _weight_strides(far) == (False, (36, 9, 3, 1))


def test_weights_of_2_31_elements_go_to_a_64_bit_family():
    """Only the families that index weights in 64 bits take a weight of 2^31 elements."""
    x = torch.empty(1, 1 << 15, 4, 4, device="meta")
    w = torch.empty(1 << 16, 1 << 15, 1, 1, device="meta")
    from kernelgen.families import get_family

    spec, _ = kernelgen.functional.spec_for(x, w, device="cuda")
    assert get_family(spec.family).wide_weights  # (on CUDA only `direct` does)
    with pytest.raises(kernelgen.ConvArgumentError, match="indexes weights in 32 bits"):
        kernelgen.functional.spec_for(x, w, device="cuda", family="pointwise")


def test_empty_batch():
    y = kernelgen.conv2d(torch.randn(0, 4, 8, 8), torch.randn(6, 4, 3, 3))
    assert y.shape == (0, 6, 6, 6)


def test_conv2d_module_is_a_drop_in():
    torch.manual_seed(0)
    ref = torch.nn.Conv2d(4, 6, kernel_size=(3, 5), stride=(1, 2), padding=(1, 2), dilation=1, groups=2)
    mine = kernelgen.Conv2d(4, 6, kernel_size=(3, 5), stride=(1, 2), padding=(1, 2), dilation=1, groups=2)
    assert mine.state_dict().keys() == ref.state_dict().keys()
    mine.load_state_dict(ref.state_dict())
    ref.load_state_dict(mine.state_dict())
    x = torch.randn(2, 4, 12, 13)
    with torch.no_grad():
        assert rel_err(mine(x), ref(x).double()) <= 1e-5


@pytest.mark.parametrize("mode", ["reflect", "replicate", "circular"])
def test_conv2d_module_padding_modes(mode):
    ref = torch.nn.Conv2d(3, 4, 3, padding=1, padding_mode=mode)
    mine = kernelgen.Conv2d(3, 4, 3, padding=1, padding_mode=mode)
    mine.load_state_dict(ref.state_dict())
    x = torch.randn(1, 3, 9, 9)
    with torch.no_grad():
        assert rel_err(mine(x), ref(x).double()) <= 1e-5


def test_forward_with_grad_runs_backward():
    m = kernelgen.Conv2d(3, 4, 3)
    y = m(torch.randn(1, 3, 8, 8))
    assert y.requires_grad
    y.sum().backward()
    assert m.weight.grad is not None and m.bias.grad is not None  # (values: tests/test_autograd.py)


def test_each_spec_compiles_once_per_process(fresh_cache):
    x = torch.randn(1, 3, 10, 10)
    w = torch.randn(4, 3, 3, 3)
    before = kernelgen.stats()["compiles"]
    for _ in range(10):
        kernelgen.conv2d(x, w)
    assert kernelgen.stats()["compiles"] == before + 1
    # a different batch size or image size reuses the same kernel
    kernelgen.conv2d(torch.randn(3, 3, 17, 12), w)
    assert kernelgen.stats()["compiles"] == before + 1


SAMPLED = [
    # (N, C, H, W), K, stride: even and odd planes, unequal strides, a stride past the plane
    ((2, 8, 14, 14), 6, 2), ((2, 8, 15, 13), 6, (2, 3)), ((1, 4, 9, 11), 5, (3, 1)), ((2, 4, 5, 4), 3, (1, 7)),
]


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("xshape,K,stride", SAMPLED)
def test_sampled_1x1_view_matches_f_conv2d(xshape, K, stride, bias, fresh_cache, monkeypatch):
    """The plan machinery of select.sampled_1x1 (CUDA only) run through the CPU family: the
    rule widened to every device, the call computed on input[..., ::sh, ::sw] at stride 1,
    first through the full path, then through the plan record on disk, on dense, strided and
    unbatched inputs."""
    from kernelgen import functional, select

    real = select.sampled_1x1
    monkeypatch.setattr(select, "sampled_1x1", lambda spec, device, cl: real(spec, "cuda", cl))
    torch.manual_seed(0)
    x = torch.randn(*xshape)
    w = torch.randn(K, xshape[1], 1, 1)
    b = torch.randn(K) if bias else None
    spec, call = functional.spec_for(x, w, b, stride=stride)
    sh, sw = (stride, stride) if isinstance(stride, int) else stride
    assert spec.stride == (1, 1) and call.sample == (sh, sw) and (call.H, call.W) == (call.P, call.Q)
    wide = torch.randn(xshape[0], xshape[1], xshape[2], xshape[3] + 3)[..., 1:xshape[3] + 1]  # a strided view
    for inp in (x, wide, x[0]):
        ref = reference(inp, w, b, stride=stride)
        for _ in range(2):  # the full path, then (plans forgotten) the record on disk
            y = kernelgen.conv2d(inp, w, b, stride=stride)
            assert y.shape == ref.shape and rel_err(y, ref) < 1e-6
            functional.clear_plans()
