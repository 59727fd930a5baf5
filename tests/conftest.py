"""Shared fixtures: the example models, loaded by file path (examples/ is not a package)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

import portable

EXAMPLES_DIR = Path(__file__).resolve().parents[1] / "examples"
# file stem -> decorated name
EXAMPLE_NAMES = {"mlp": "MLP", "gpt": "GPT", "llama": "Llama", "cnn": "CNN", "moe": "MoE"}


def _load_spec(stem: str) -> portable.ModelSpec:
    name = f"_portable_example_{stem}"
    module = sys.modules.get(name)
    if module is None:
        spec = importlib.util.spec_from_file_location(name, EXAMPLES_DIR / f"{stem}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return portable.spec_of(getattr(module, EXAMPLE_NAMES[stem]))


@pytest.fixture
def example_spec():
    """`example_spec("gpt")` -> the ModelSpec of examples/gpt.py:GPT."""
    return _load_spec
