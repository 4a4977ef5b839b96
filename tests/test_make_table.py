"""CPU-tier tests of benchmarks/make_table.py's offline parts (no GPU): the refit of a table's cost
model on the GPU facts the table was measured with."""

from __future__ import annotations

import json
import math
import shutil

from benchmark_modules import ROOT, load



make_table = load("make_table")


def test_shipped_tables_models_are_fitted_to_their_rows_by_todays_cost_hooks(tmp_path):
    """Each shipped table's model is what fit_model gives on its own rows and recorded GPU: a
    family whose cost hooks changed after its rows were measured needs `make_table.py --refit`
    (else the selector ranks it with coefficients fitted to other estimates)."""
    tables = sorted((ROOT / "kernelgen" / "tables").glob("*.json"))
    assert tables
    for path in tables:
        copy = tmp_path / path.name
        shutil.copy(path, copy)
        assert make_table.main(["--refit", str(copy)]) == 0
        before, after = json.loads(path.read_text()), json.loads(copy.read_text())
        assert after["rows"] == before["rows"]
        assert after["provenance"]["refit"]["command"].startswith("python benchmarks/make_table.py --refit")
        assert set(after["model"]) == set(before["model"])
        for fam, coef in before["model"].items():
            for a, b in zip(coef, after["model"][fam]):
                assert math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-12), (path.name, fam, coef, after["model"][fam])
