"""Hostile and odd calls (issue 54): every integer bounded before it reaches C++, views with the
negative/conjugate bit, F.conv2d's answers and errors at the edges. CPU tier: the same spec,
plan and cache code serves CUDA."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import kernelgen
from kernelgen.errors import ConvArgumentError
from kernelgen.spec import INT_MAX, ConvSpec

pytestmark = pytest.mark.compile


def _same(a, b):
    assert a.shape == b.shape and a.dtype == b.dtype
    torch.testing.assert_close(a, b, equal_nan=True)


# -- item 1: integers of 2^31 and more ------------------------------------------------------------

@pytest.mark.parametrize("kw", [dict(stride=2**31), dict(stride=2**32), dict(stride=(2**31, 1)),
                                dict(stride=(1, 2**62), padding=1), dict(stride=2**63 - 1)])
def test_huge_strides_compute_what_torch_computes(fresh_cache, kw):
    """A stride past the input takes one window: computed as torch does, not wrapped to 0 in an int."""
    x, w = torch.randn(1, 2, 4, 5), torch.randn(3, 2, 2, 2)
    _same(kernelgen.conv2d(x, w, **kw), F.conv2d(x, w, **kw))


def test_huge_dilation_of_a_one_wide_kernel(fresh_cache):
    x, w = torch.randn(1, 2, 4, 5), torch.randn(3, 2, 1, 2)
    _same(kernelgen.conv2d(x, w, dilation=(2**40, 1)), F.conv2d(x, w, dilation=(2**40, 1)))


@pytest.mark.parametrize("kw", [dict(stride=2**63), dict(stride=2**64), dict(padding=2**63), dict(groups=2**63),
                                dict(padding=2**62), dict(dilation=2**40)])
def test_values_torch_refuses_raise_torchs_error(kw):
    x, w = torch.randn(1, 1, 4, 4), torch.randn(1, 1, 2, 2)
    with pytest.raises((ValueError, RuntimeError)) as theirs:
        F.conv2d(x, w, **kw)
    with pytest.raises(ConvArgumentError) as ours:
        kernelgen.conv2d(x, w, **kw)
    assert str(theirs.value).split(":")[0][:40] in str(ours.value)


@pytest.mark.parametrize("kw", [dict(padding=2**31), dict(stride=2**31, padding=2**31), dict(padding=(0, INT_MAX)),
                                dict(dilation=(1, 2**63 - 1))])  # (where torch's int64 overflows silently)
def test_sizes_past_32_bits_are_refused_before_rendering(kw):
    x, w = torch.randn(1, 1, 4, 4), torch.randn(1, 1, 2, 2)
    with pytest.raises(ConvArgumentError, match="at most 2147483647|Kernel size can't be greater"):
        kernelgen.conv2d(x, w, **kw)


@pytest.mark.parametrize("field,value", [("stride", 2**31), ("dilation", (1, 2**31)), ("padding", (0, 0, 2**31, 0)),
                                         ("kernel_size", 2**31), ("in_channels", 2**31), ("stride", 2**64)])
def test_spec_bounds_every_integer(field, value):
    base = dict(in_channels=1, out_channels=1, kernel_size=2, device="cpu", family="cpu_direct")
    with pytest.raises(ConvArgumentError):
        ConvSpec(**{**base, field: value})


def test_spec_bounds_derived_products():
    with pytest.raises(ConvArgumentError, match="dilated kernel"):
        ConvSpec(in_channels=1, out_channels=1, kernel_size=3, dilation=2**30, device="cpu", family="cpu_direct")
    with pytest.raises(ConvArgumentError, match="reduction length"):
        ConvSpec(in_channels=2**16, out_channels=1, kernel_size=(2**8, 2**8), device="cpu", family="cpu_direct")


def test_render_refuses_a_huge_stride(fresh_cache):
    r = subprocess.run([sys.executable, "-m", "kernelgen", "render", "--device", "cpu", "--input", "1,1,4,4",
                        "--weight", "1,1,2,2", "--stride", str(2**63), "--padding", str(2**31)],
                       capture_output=True, text=True, env=dict(os.environ, KERNELGEN_CACHE_DIR=str(fresh_cache)))
    assert r.returncode != 0 and "SH = 9223372036854775808" not in r.stdout
    assert "Overflow" in r.stderr


# -- item 2: the negative bit ----------------------------------------------------------------------

def _neg_view(t):
    """`t`'s values, stored negated under the negative bit (as x.conj().imag is)."""
    return torch._neg_view(-t)


@pytest.mark.parametrize("which", ["input", "weight", "bias", "all"])
def test_negative_bit_views_are_resolved(fresh_cache, which):
    x, w, b = torch.randn(2, 3, 6, 7), torch.randn(4, 3, 3, 3), torch.randn(4)
    args = {"input": x, "weight": w, "bias": b}
    for name in args:
        if which in (name, "all"):
            args[name] = _neg_view(args[name])
            assert args[name].is_neg()
    _same(kernelgen.conv2d(**args, padding=1), F.conv2d(x, w, b, padding=1))


def test_imag_of_a_conjugate(fresh_cache):
    x = torch.randn(1, 1, 5, 5, dtype=torch.complex64).conj().imag
    w = torch.randn(1, 1, 3, 3)
    assert x.is_neg()
    _same(kernelgen.conv2d(x, w), F.conv2d(x, w))
