"""First-call observability (issue 55): a call that compiles says so, once loudly per process, with
the kernel it chose and how long the call waited.

Tier: compile (builds two small CPU kernels, about a second each).
"""

from __future__ import annotations

import logging

import pytest
import torch

import kernelgen
from kernelgen import functional

pytestmark = pytest.mark.compile


def test_compiles_are_logged_first_at_warning_then_at_info(fresh_cache, monkeypatch, caplog):
    monkeypatch.setattr(functional, "_compiled_before", False)
    x, w = torch.randn(1, 3, 6, 6), torch.randn(2, 3, 3, 3)
    with caplog.at_level(logging.DEBUG, logger="kernelgen"):
        kernelgen.conv2d(x, w)
        first = [r for r in caplog.records if r.name == "kernelgen" and r.levelno == logging.WARNING]
        assert len(first) == 1
        # one line a compile above DEBUG: the cache's own lines are DEBUG
        assert len([r for r in caplog.records if r.levelno >= logging.INFO]) == 1
        text = first[0].getMessage()
        assert "(1, 3, 6, 6)" in text and "cpu_direct[" in text and " s: " in text and "kernelgen warm" in text
        assert "\n" not in text

        caplog.clear()
        kernelgen.conv2d(torch.randn(2, 3, 8, 8), w, padding=1)  # another kernel: INFO, not WARNING again
        levels = [r.levelno for r in caplog.records if r.getMessage().startswith("compiled conv2d(")]
        assert levels == [logging.INFO]
        assert len([r for r in caplog.records if r.levelno >= logging.INFO]) == 1
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING]

        caplog.clear()
        kernelgen.conv2d(torch.randn(2, 3, 8, 8), w)  # a new signature served by the first kernel: DEBUG only
        mine = [r for r in caplog.records if r.pathname.endswith("functional.py")]
        assert [r.levelno for r in mine] == [logging.DEBUG] and "not compiled" in mine[0].getMessage()

        caplog.clear()
        kernelgen.conv2d(x, w)  # a memoised plan: nothing
        assert not [r for r in caplog.records if r.pathname.endswith("functional.py")]
