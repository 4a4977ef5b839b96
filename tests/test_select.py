"""The selector (kernelgen/select.py) and its data (table.py, costmodel.py): CPU tier, no GPU.

Which family runs a call is decided by measurements, so these tests give the selector measured
data of their own (synthetic tables in a temporary table directory) and check that the data, not a
rule in code, decides; that the choice is deterministic; that a GPU model without a table of its
own uses one of its target's, and a target without one falls back on the cost model; and that no
family or selector module holds a GPU's numbers as literals.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from kernelgen import select, table
from kernelgen.device import Device, nominal
from kernelgen.errors import ConvArgumentError
from kernelgen.spec import ConvSpec, Problem

PKG = Path(__file__).resolve().parent.parent / "kernelgen"
LAYER = dict(N=32, C=64, K=64, H=56, W=56, kernel=[3, 3], stride=[1, 1], padding=[1, 1], dilation=[1, 1], groups=1,
             bias=False)


def _params(L=LAYER, dtype="bfloat16"):
    return dict(in_channels=L["C"], out_channels=L["K"], kernel_size=tuple(L["kernel"]), stride=tuple(L["stride"]),
                padding=tuple(L["padding"]), dilation=tuple(L["dilation"]), groups=L["groups"], dtype=dtype,
                bias=L["bias"])


def _problem(L=LAYER, device=None):
    P, Q = ConvSpec(**_params(L)).output_size(L["H"], L["W"])
    return Problem(L["N"], L["H"], L["W"], P, Q, device=device or nominal("sm_90a"))


@pytest.fixture
def tables(tmp_path, monkeypatch):
    """A table directory of this test's own (the checked-in tables out of the way)."""
    monkeypatch.setattr(table, "TABLE_DIR", tmp_path)
    table._tables.cache_clear()
    yield tmp_path
    table._tables.cache_clear()


def _write(directory: Path, gpu: Device, times: dict[str, float], layers=(LAYER,)):
    """A table for `gpu` whose rows measured `times` (family -> us) on each layer, in bf16-cl."""
    rows = []
    for L in layers:
        firsts, _ = select.candidates(_params(L), "cuda", _problem(L, gpu), True, "ieee")
        specs = {s.family: s.to_json() for s in firsts if s.family in times}
        rows.append({"layer": {"name": "t", **L}, "cell": "bf16-cl", "times_us": {f: times[f] for f in specs},
                     "specs": specs, "torch_us": 10.0})
    data = {"format": table.FORMAT, "provenance": {"gpu": gpu.name, "arch": gpu.arch, "device": gpu.to_dict()},
            "rows": rows, "model": {}}
    (directory / f"{gpu.key}.json").write_text(json.dumps(data))
    table._tables.cache_clear()


def _choose(device=None, L=LAYER):
    return select.choose(_params(L), "cuda", _problem(L, device), True, "ieee")


def test_the_measured_table_decides(tables):
    gpu = nominal("sm_90a")
    _write(tables, gpu, {"nhwc": 10.0, "nhwc_tma": 40.0, "direct": 400.0})
    assert _choose(gpu).family == "nhwc"
    _write(tables, gpu, {"nhwc": 40.0, "nhwc_tma": 10.0, "direct": 400.0})
    assert _choose(gpu).family == "nhwc_tma"


def test_near_layers_speak_for_one_never_measured(tables):
    gpu = nominal("sm_90a")
    near = [dict(LAYER, N=n, H=h, W=h) for n, h in ((16, 56), (32, 48), (64, 56))]
    _write(tables, gpu, {"nhwc": 10.0, "nhwc_tma": 60.0, "direct": 400.0}, layers=near)
    assert _choose(gpu).family == "nhwc"
    _write(tables, gpu, {"nhwc": 60.0, "nhwc_tma": 10.0, "direct": 400.0}, layers=near)
    assert _choose(gpu).family == "nhwc_tma"


def test_another_model_of_the_same_target_uses_its_table_and_another_target_does_not(tables):
    h200 = nominal("sm_90a", wide_dram=True)
    _write(tables, h200, {"nhwc": 10.0, "nhwc_tma": 80.0, "direct": 400.0})
    assert table.for_device(nominal("sm_90a")).name == h200.key  # an H100 reads the H200's
    assert _choose(nominal("sm_90a")).family == "nhwc"
    assert table.for_device(nominal("sm_80")) is None


def test_without_a_table_the_cost_model_decides_deterministically(tables):
    gpu = nominal("sm_90a")
    first = _choose(gpu)
    assert all(_choose(gpu) == first for _ in range(3))
    assert table.scores([first], _problem(device=gpu), True, "ieee") is None
    # the families the sm_80 part cannot run are not candidates there
    found, reasons = select.candidates(_params(), "cuda", _problem(device=nominal("sm_80")), True, "ieee")
    assert {s.family for s in found}.isdisjoint({"nhwc_tma", "wgmma", "pointwise_tma"})
    assert "nhwc_tma runs on sm_90a (target sm_80)" in reasons  # (the family's own words, named once)


def test_ranked_puts_every_familys_first_choice_before_other_configurations(tables):
    specs = select.ranked(_params(), "cuda", _problem(), True, "ieee", every=True)
    firsts = select.ranked(_params(), "cuda", _problem(), True, "ieee")
    assert specs[:len(firsts)] == firsts and len(specs) > len(firsts)
    assert len(set(specs)) == len(specs)
    for spec in specs:  # every candidate is a spec its family accepts on this GPU
        from kernelgen.families import get_family

        get_family(spec.family).check(spec, nominal("sm_90a"))


def test_forcing_and_its_errors(tables):
    assert select.choose(_params(), "cuda", _problem(), True, "ieee", family="direct").family == "direct"
    with pytest.raises(ConvArgumentError, match="family 'wgmma' cannot serve"):
        select.choose(_params(), "cuda", _problem(), True, "ieee", family="wgmma")  # NCHW only
    with pytest.raises(ConvArgumentError, match="wgmma runs on sm_90a \\(target sm_80\\)"):
        select.choose(_params(), "cuda", _problem(device=nominal("sm_80")), False, "ieee", family="wgmma")


def test_a_table_of_another_format_is_refused(tmp_path):
    path = tmp_path / "x.json"
    path.write_text(json.dumps({"format": 99, "rows": []}))
    with pytest.raises(ValueError, match="format"):
        table.read(path)


def test_the_checked_in_tables_load_and_name_their_provenance():
    table._tables.cache_clear()
    for tbl in table._tables().values():
        for field in ("gpu", "arch", "device", "driver", "torch", "commit", "date", "command"):
            assert field in tbl.provenance, (tbl.name, field)
        assert tbl.rows and all(r.times for r in tbl.rows)
        assert tbl.name == Device(**tbl.provenance["device"]).key


# The numbers that describe a GPU live in kernelgen/device.py alone.
GPU_LITERALS = re.compile(r"(?<![\w.])(132|108|142|227 \* 1024|228 \* 1024|163 \* 1024|232448|233472)(?![\w.])")


@pytest.mark.parametrize("path", sorted((PKG / "families").glob("*.py")) + [PKG / "select.py", PKG / "table.py",
                                                                          PKG / "costmodel.py"],
                         ids=lambda p: p.name)
def test_no_family_or_selector_module_holds_a_gpus_numbers(path):
    code = "\n".join(line.split("#")[0] for line in path.read_text().splitlines())
    code = re.sub(r'"""(.|\n)*?"""', "", code)  # docstrings may cite a card's numbers
    assert not GPU_LITERALS.search(code), GPU_LITERALS.search(code).group(0)


def test_a_transient_weight_charges_its_packing_to_families_that_pack():
    """Problem.transient (a gradient's operand): a family that packs its weights pays the packing in
    the estimate, one that reads them as they lie does not; transient calls plan apart."""
    import dataclasses

    import torch

    from kernelgen import costmodel, functional

    dev = nominal("sm_90a")
    x = torch.empty(32, 256, 14, 14, dtype=torch.bfloat16, device="meta").contiguous(memory_format=torch.channels_last)
    w = torch.empty(1024, 32, 14, 14, dtype=torch.bfloat16, device="meta")
    with functional.planning_for(dev):
        specs, call = functional.candidates_for(x.permute(1, 0, 2, 3), w, None, device="cuda")
    problem = Problem(call.N, call.H, call.W, call.P, call.Q, device=dev)
    moved = dataclasses.replace(problem, transient=True)
    by_family = {s.family: s for s in specs}
    packs, reads = by_family["nhwc_tma"], by_family["wgrad"]
    assert packs.template_context()["PACKED_BYTES"] and not reads.template_context()["PACKED_BYTES"]
    extra = costmodel.estimate(packs, moved) - costmodel.estimate(packs, problem)
    assert extra == pytest.approx(costmodel.pack_seconds(packs, problem, dev)) and extra > 20e-6
    assert costmodel.estimate(reads, moved) == costmodel.estimate(reads, problem)
    a = torch.randn(1, 3, 5, 5)
    b = torch.randn(4, 3, 3, 3)
    with functional.transient_weights():
        inside = functional.signature(a, b, None, 1, 0, 1, 1, None, None, None)
    assert inside != functional.signature(a, b, None, 1, 0, 1, 1, None, None, None)
