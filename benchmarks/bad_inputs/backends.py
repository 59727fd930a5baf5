"""Backends on loaded archives, a base install without the optional packages, `portable check`
of what `lower` wrote, target names (issue 13, items 7, 8, 16 and 19). A base install is what
`import` sees when Python's path finder does not find jax, jaxlib, triton, onnx, onnxruntime and
onnxscript (a subprocess)."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from .base import Scenario

REPO = Path(__file__).resolve().parents[2]
MLP = f"{REPO}/examples/mlp.py:MLP"
GPT = f"{REPO}/examples/gpt.py:GPT"
OPTIONAL = "jax,jaxlib,triton,onnx,onnxruntime,onnxscript"


@dataclasses.dataclass
class Outcome:
    kind: str  # ok | typed | crash | wrong
    detail: str


_HIDE = """
import sys, importlib.machinery as m
_f = m.PathFinder.find_spec
_hidden = set(sys.argv[1].split(',')) - {''}
m.PathFinder.find_spec = staticmethod(
    lambda n, p=None, t=None: None if n.split('.')[0] in _hidden else _f(n, p, t))
sys.argv = ['portable'] + sys.argv[2:]
from portable.cli import main
sys.exit(main())
"""


def _cli_without(hidden: str, *argv: str) -> tuple[int, str, str]:
    done = subprocess.run(
        [sys.executable, "-c", _HIDE, hidden, *argv], capture_output=True, text=True, timeout=600
    )
    return done.returncode, done.stdout, done.stderr


def _cli(*argv: str) -> tuple[int, str, str]:
    return _cli_without("", *argv)


def _by_exit(code: int, want: int, err: str) -> Outcome:
    if code == want:
        return Outcome(
            "typed" if want else "ok", err.strip().splitlines()[0] if err.strip() else ""
        )
    return Outcome("crash" if code == 70 else "wrong", f"exit {code}: {err.strip()[-300:]}")


# -- item 7: a loaded archive on every backend ---------------------------------------------------


def loaded_archive_lowers_on_cuda(tmp: Path) -> Outcome:
    """`portable lower ARCHIVE -t cuda` of a saved GPT (was: exit 70, KeyError: 'val')."""
    code, _, err = _cli("lower", GPT, "-t", "cpu", "-o", str(tmp / "a"), "-q")
    if code:
        return Outcome("crash", err)
    code, _, err = _cli("lower", str(tmp / "a" / "program.portable"), "-t", "cuda", "-o",
                        str(tmp / "b"), "-q")  # fmt: skip
    return _by_exit(code, 0, err)


def loaded_archive_equals_fresh_on_every_backend(tmp: Path) -> Outcome:
    """Lowered texts of a loaded GPT equal the fresh capture's on cpu/xla/neuron/cuda/onnx."""
    sys.path.insert(0, str(REPO))
    import portable
    from portable.backends import Target, get_backend
    from tests.support import load_spec

    fresh = portable.capture_spec(load_spec("gpt"))
    loaded = portable.load(fresh.save(tmp / "gpt.portable"))
    for name in ("cpu", "xla", "neuron", "cuda", "onnx"):
        try:
            a = get_backend(name).lower(fresh, Target(name)).texts
            b = get_backend(name).lower(loaded, Target(name)).texts
        except portable.PortableError as exc:
            return Outcome("typed", f"{name}: {exc.what}")
        except Exception as exc:  # noqa: BLE001
            return Outcome("crash", f"{name}: {type(exc).__name__}: {exc}")
        if a != b:
            return Outcome("wrong", f"{name}: texts differ")
    return Outcome("ok", "equal on 5 backends")


# -- item 8: a base install ---------------------------------------------------------------------


def backends_listing_on_a_base_install(tmp: Path) -> Outcome:
    """`portable backends --json` without jax/triton/onnx (was: exit 70, ImportError jax)."""
    code, out, err = _cli_without(OPTIONAL, "backends", "--json")
    if code:
        return _by_exit(code, 0, err)
    rows = {r["name"]: r for r in json.loads(out)}
    ok = all(rows[n]["missing"] and rows[n]["install"] for n in ("xla", "neuron", "cuda", "onnx"))
    return Outcome("ok" if ok else "wrong", json.dumps({n: r["install"] for n, r in rows.items()}))


def _refused(target: str) -> Callable[[Path], Outcome]:
    def scenario(tmp: Path) -> Outcome:
        code, _, err = _cli_without(OPTIONAL, "lower", MLP, "-t", target, "-o", str(tmp / "o"))
        outcome = _by_exit(code, 4, err)
        if outcome.kind == "typed" and (tmp / "o").exists():
            return Outcome("wrong", "output written although refused")
        return outcome

    scenario.__doc__ = f"`portable lower -t {target}` on a base install: BackendError, exit 4"
    scenario.__name__ = f"lower_{target}_on_a_base_install"
    return scenario


def check_on_a_base_install(tmp: Path) -> Outcome:
    """`portable check DIR` without jax: BackendError exit 4 (was: a bogus artifact-hlo finding)."""
    code, _, err = _cli("lower", MLP, "-t", "neuron", "-o", str(tmp / "n"), "-q")
    if code:
        return Outcome("crash", err)
    code, _, err = _cli_without(OPTIONAL, "check", str(tmp / "n"))
    return _by_exit(code, 4, err)


def python_api_on_a_base_install(tmp: Path) -> Outcome:
    """portable.lower / portable.compile of xla, neuron, cuda, onnx: BackendError each."""
    code = (
        "import sys, importlib.machinery as m\n"
        "_f = m.PathFinder.find_spec\n"
        f"m.PathFinder.find_spec = staticmethod(lambda n, p=None, t=None: None if n.split('.')[0] "
        f"in {set(OPTIONAL.split(','))!r} else _f(n, p, t))\n"
        "import torch, portable\n"
        "p = portable.capture(torch.nn.Linear(4, 2), (torch.randn(3, 4),))\n"
        "bad = []\n"
        "for b in ('xla', 'neuron', 'cuda', 'onnx'):\n"
        "    for f in (portable.lower, portable.compile):\n"
        "        try:\n"
        "            f(p, b); bad.append(f'{b}: no error')\n"
        "        except portable.BackendError:\n"
        "            pass\n"
        "        except Exception as e:\n"
        "            bad.append(f'{b}: {type(e).__name__}')\n"
        "print(';'.join(bad))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    if done.returncode:
        return Outcome("crash", done.stderr[-300:])
    bad = done.stdout.strip()
    return Outcome("typed" if not bad else "crash", bad or "8 BackendErrors")


# -- item 16: check after a TP lowering -----------------------------------------------------------


def check_accepts_a_per_rank_output(tmp: Path) -> Outcome:
    """lower a per-rank program with a rank_id input, then `portable check` (was: exit 6,
    "HLO has N+1 parameters for N signature inputs")."""
    sys.path.insert(0, str(REPO))
    sys.path.insert(0, str(REPO / "tests"))
    from test_xla_spmd import tp_mlp_program

    program, _, _ = tp_mlp_program()
    archive = program.save(tmp / "tp.portable")
    code, _, err = _cli("lower", str(archive), "-t", "neuron:trn3", "-o", str(tmp / "o"), "-q")
    if code:
        return _by_exit(code, 0, err)
    code, out, err = _cli("check", str(tmp / "o"))
    return _by_exit(code, 0, out + err)


# -- item 19 ----------------------------------------------------------------------------------


def bare_neuron_target_is_checkable(tmp: Path) -> Outcome:
    """`-t neuron` writes neuron_trn3/ and `portable check` finds it (was: neuron/, exit 3)."""
    code, _, err = _cli("lower", MLP, "-t", "neuron", "-o", str(tmp / "o"), "-q")
    if code or not (tmp / "o" / "neuron_trn3").is_dir():
        return Outcome("wrong", f"exit {code}, {sorted(p.name for p in (tmp / 'o').iterdir())}")
    code, out, err = _cli("check", str(tmp / "o"))
    return _by_exit(code, 0, out + err)


def failed_pt2_export_writes_nothing(tmp: Path) -> Outcome:
    """torch.export refusing the cuda .pt2: LoweringError saying nothing was written, and
    nothing is (was: "the kernels and graph.py are still usable")."""
    import torch

    import portable

    program = portable.capture(torch.nn.Linear(4, 2), (torch.randn(3, 4),))
    real = torch.export.export

    def refuse(*a, **k):
        raise RuntimeError("export refused")

    torch.export.export = refuse
    try:
        portable.lower(program, "cuda:sm_90", tmp / "cuda")
    except portable.LoweringError as exc:
        if (tmp / "cuda").exists() or "nothing was written" not in (exc.fix or ""):
            return Outcome("wrong", str(exc))
        return Outcome("typed", exc.what)
    except Exception as exc:  # noqa: BLE001
        return Outcome("crash", f"{type(exc).__name__}: {exc}")
    finally:
        torch.export.export = real
    return Outcome("wrong", "no error")


def unknown_variant_refused_before_capture(tmp: Path) -> Outcome:
    """`-t neuron:trn9`: BackendError exit 4 before capture, nothing written."""
    code, _, err = _cli("lower", MLP, "-t", "neuron:trn9", "-o", str(tmp / "o"))
    if "capturing" in err:
        return Outcome("wrong", "refused only after capture")
    return _by_exit(code, 4, err)


def _as_outcome(fn: Callable[[Path], Outcome]) -> Callable[[Path], str]:
    def run(tmp: Path) -> str:
        outcome = fn(tmp)
        return "ok" if outcome.kind == "ok" else f"{outcome.kind}:{outcome.detail[:200]}"

    return run


def _scenario(name: str, fn: Callable[[Path], Outcome], expect: str = "typed", quick=False):
    """Backend scenarios start subprocesses; CI runs them as tests/test_backends_loaded.py,
    test_optional_deps.py and test_neuron*.py, so they are not in the quick form."""
    return Scenario(name, "backend", _as_outcome(fn), expect=expect, quick=quick, timeout=600)


SCENARIOS = [
    _scenario("lower a loaded GPT archive for cuda", loaded_archive_lowers_on_cuda, "works"),
    _scenario(
        "loaded GPT lowers as the fresh one, 5 backends",
        loaded_archive_equals_fresh_on_every_backend,
        "works",
    ),
    _scenario(
        "portable backends, base install", backends_listing_on_a_base_install, "works", False
    ),
    *(
        _scenario(f"lower -t {t}, base install", _refused(t), quick=False)
        for t in ("neuron", "xla", "cuda", "onnx", "all")
    ),
    _scenario("portable check, base install", check_on_a_base_install, quick=False),
    _scenario("portable.lower/compile, base install", python_api_on_a_base_install, quick=False),
    _scenario("check a per-rank neuron output", check_accepts_a_per_rank_output, "works"),
    _scenario("-t neuron, then check", bare_neuron_target_is_checkable, "works"),
    _scenario("cuda .pt2 export fails", failed_pt2_export_writes_nothing, quick=True),
    _scenario("-t neuron:trn9", unknown_variant_refused_before_capture),
]
