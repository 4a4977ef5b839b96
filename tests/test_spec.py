"""Pure tier: ConvSpec canonicalisation and validation."""

import pytest
import torch

from kernelgen import ConvArgumentError, ConvSpec


def test_ints_become_pairs_and_dtypes_names():
    s = ConvSpec(4, 8, 3, stride=2, padding=1, dilation=1, dtype=torch.float16)
    assert s.kernel_size == (3, 3) and s.stride == (2, 2) and s.dilation == (1, 1)
    assert s.padding == (1, 1, 1, 1)
    assert s.dtype == "float16"
    assert ConvSpec(4, 8, [3, 5], stride=[1], dtype="torch.bfloat16").kernel_size == (3, 5)


@pytest.mark.parametrize("k,d,expect", [
    ((3, 3), (1, 1), (1, 1, 1, 1)),
    ((4, 2), (1, 1), (1, 2, 0, 1)),   # even kernels pad one more at the end, as torch does
    ((3, 4), (2, 3), (2, 2, 4, 5)),
])
def test_same_padding(k, d, expect):
    assert ConvSpec(1, 1, k, padding="same", dilation=d).padding == expect


def test_valid_padding():
    assert ConvSpec(1, 1, 3, padding="valid").padding == (0, 0, 0, 0)


@pytest.mark.parametrize("kwargs,match", [
    (dict(stride=0), "non-positive stride"),
    (dict(stride=(1, -1)), "non-positive stride"),
    (dict(dilation=0), "dilation should be greater than zero"),
    (dict(padding=-1), "negative padding"),
    (dict(padding="full"), "Invalid padding string 'full'"),
    (dict(padding="same", stride=2), "not supported for strided"),
    (dict(groups=0), "non-positive groups"),
    (dict(groups=3), "groups=3 does not divide in_channels=4"),
    (dict(stride=(1, 2, 3)), "list of 2 values"),
    (dict(layout="nchwc"), "layout must be one of"),
    (dict(math="fast"), "math must be one of"),
    (dict(family="nope"), "unknown kernel family 'nope'"),
    (dict(family="direct", tiles={"block_x": 1}), "no tile parameter"),
    (dict(family="direct", tiles={"block_p": 5}), "choose one of"),
])
def test_bad_values_are_value_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ConvSpec(4, 8, 3, **kwargs)


def test_argument_errors_are_runtime_errors_too():
    with pytest.raises(RuntimeError):
        ConvSpec(4, 8, 3, stride=0)


@pytest.mark.parametrize("kwargs", [dict(stride="2"), dict(stride=1.5), dict(kernel_size=True),
                                    dict(padding=(1, "1")), dict(groups=2.0), dict(bias="yes")])
def test_non_integers_are_type_errors(kwargs):
    base = dict(in_channels=4, out_channels=8, kernel_size=3)
    base.update(kwargs)
    with pytest.raises(TypeError):
        ConvSpec(**base)


def test_injection_attempts_never_reach_source():
    # Text where a number belongs is refused before any template sees it.
    with pytest.raises(TypeError):
        ConvSpec(4, 8, "3); system(\"rm -rf /\"); //")
    with pytest.raises(TypeError):
        ConvSpec(4, 8, 3, dtype="float; evil")


def test_dtype_errors():
    with pytest.raises(TypeError, match="float32, float16, bfloat16, float64"):
        ConvSpec(4, 8, 3, dtype=torch.int32)


def test_tf32_only_for_float32():
    with pytest.raises(ValueError, match="float32 only"):
        ConvSpec(4, 8, 3, dtype="float16", math="tf32")


def test_depthwise_with_multiplier():
    s = ConvSpec(16, 32, 3, groups=16)
    assert s.cin_per_group == 1 and s.cout_per_group == 2


def test_frozen_hashable_and_json_roundtrip():
    s = ConvSpec(4, 8, (3, 5), stride=(1, 2), padding="same" if False else 2, groups=2, bias=True,
                 family="direct", tiles={"block_p": 16, "cout_tile": 4})
    with pytest.raises(Exception):
        s.in_channels = 5  # type: ignore[misc]
    assert {s: 1}[s] == 1
    again = ConvSpec.from_dict(__import__("json").loads(s.to_json()))
    assert again == s and again.to_json() == s.to_json()
    # unnamed tile parameters take their first allowed value
    assert dict(s.tiles)["block_q"] == 8


def test_keyword_order_does_not_matter():
    a = ConvSpec(in_channels=4, out_channels=8, kernel_size=3, stride=2, groups=2)
    b = ConvSpec(groups=2, stride=(2, 2), kernel_size=(3, 3), out_channels=8, in_channels=4)
    assert a == b and a.to_json() == b.to_json()


def test_from_dict_rejects_unknown_fields():
    with pytest.raises(ValueError, match="unknown spec field"):
        ConvSpec.from_dict({"in_channels": 1, "out_channels": 1, "kernel_size": 1, "colour": "red"})


def test_output_size():
    s = ConvSpec(1, 1, (3, 5), stride=(2, 1), padding=(1, 2), dilation=(1, 2))
    assert s.output_size(17, 19) == (9, 15)
