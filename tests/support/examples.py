"""The example models of examples/, loaded by file path (examples/ is not a package)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import portable

EXAMPLES_DIR = Path(__file__).resolve().parents[2] / "examples"
# file stem -> the name of its @portable-decorated model
EXAMPLE_NAMES = {"mlp": "MLP", "gpt": "GPT", "llama": "Llama", "cnn": "CNN", "moe": "MoE"}
EXAMPLES = tuple(EXAMPLE_NAMES)  # every example, by file stem


def load_example(stem: str) -> ModuleType:
    """`examples/<stem>.py`, imported once per process as `_portable_example_<stem>`."""
    name = f"_portable_example_{stem}"
    module = sys.modules.get(name)
    if module is None:
        spec = importlib.util.spec_from_file_location(name, EXAMPLES_DIR / f"{stem}.py")
        assert spec is not None and spec.loader is not None, f"no examples/{stem}.py"
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up in sys.modules
        try:
            spec.loader.exec_module(module)
        except BaseException:
            sys.modules.pop(name, None)
            raise
    return module


def load_spec(stem: str) -> portable.ModelSpec:
    """The ModelSpec of `examples/<stem>.py`'s decorated model (`load_spec("gpt")`)."""
    target = getattr(load_example(stem), EXAMPLE_NAMES[stem])
    spec = portable.spec_of(target)
    assert spec is not None, f"{stem}: `{EXAMPLE_NAMES[stem]}` is not decorated with @portable"
    return spec
