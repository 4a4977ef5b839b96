"""What the benchmark scripts' tests share: a script of benchmarks/ imported as a module."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def load(name: str):
    """benchmarks/<name>.py as the module `name` (registered under that name, since the scripts
    import each other by it: networks.py imports census)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
