"""The built wheel installs `portable.backends` / `portable.passes` and no generic top-level
names, and every subpackage imports from outside the repo (an editable install would hide a
missing package)."""

from __future__ import annotations

import os
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _subpackages(folder: Path, prefix: str) -> list[str]:
    return sorted(
        prefix + "." + ".".join(p.parent.relative_to(folder).parts)
        if p.parent != folder
        else prefix
        for p in folder.rglob("__init__.py")
        if "__pycache__" not in p.parts
    )


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(out),
            str(REPO),
        ],
        check=True,
        capture_output=True,
        text=True,
    )
    (path,) = out.glob("portable-*.whl")
    return path


def test_wheel_layout(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"portable"}, f"top-level names in the wheel: {sorted(tops)}"
    for module in (
        "portable/backends/__init__.py",
        "portable/backends/cpu.py",
        "portable/passes/__init__.py",
        "portable/passes/dce.py",
        "portable/cli/app.py",
        "portable/opset/table.py",
        "portable/py.typed",  # PEP 561 marker: type checkers of user code read our annotations
    ):
        assert module in names
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "portable = portable.cli.app:main" in text and "[pytest11]" in text


def test_wheel_imports_every_subpackage_outside_the_repo(wheel, tmp_path):
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    python = env_dir / "bin" / "python"
    # Dependencies (torch, numpy, safetensors) come from this interpreter's site-packages through
    # a plain path entry, so no second torch install is needed; `portable` itself can only come
    # from the wheel (an editable install's finder is not run for path entries, and the repo is
    # not on the path).
    import torch

    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    Path(site, "portable_test_deps.pth").write_text(str(Path(torch.__file__).parents[1]) + "\n")
    subprocess.run(
        [
            str(python),
            "-m",
            "pip",
            "install",
            "--no-deps",
            "--no-index",
            "--force-reinstall",
            str(wheel),
        ],
        check=True,
        capture_output=True,
        text=True,
    )
    packages = _subpackages(REPO / "portable", "portable")  # backends/, passes/ among them
    assert {"portable.backends.cuda", "portable.passes.spmd"} <= set(packages)
    code = (
        "import importlib, portable, pathlib\n"
        f"for name in {packages!r}:\n"
        "    module = importlib.import_module(name)\n"
        f"    assert not str(pathlib.Path(module.__file__).resolve()).startswith({str(REPO)!r}), module.__file__\n"
        "from portable.backends import get_backend; get_backend('cpu')\n"
        "from portable.passes import parse_pipeline; parse_pipeline('canonicalize,dce')\n"
        "print('ok', len(" + repr(packages) + "))\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH",)}
    result = subprocess.run(
        [str(python), "-c", code], cwd=tmp_path, capture_output=True, text=True, env=env
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.startswith("ok")
    cli = subprocess.run(
        [str(env_dir / "bin" / "portable"), "backends"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=env,
    )
    assert cli.returncode == 0 and "cpu" in cli.stdout
