"""pytest plugin: `--portable-backends=cpu,xla` parametrizes the `portable_backend` fixture.

A test that takes `portable_backend` runs once per listed backend; a backend that cannot run on
this machine is skipped with its reason. An unknown name is a usage error: pytest stops before
collecting anything (exit status 4) with one message naming the registered backends."""

from __future__ import annotations

import pytest

DEFAULT = "cpu"


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("portable")
    group.addoption(
        "--portable-backends",
        default=DEFAULT,
        help="comma-separated backends for tests using the `portable_backend` fixture (default: cpu)",
    )


def _backends(config: pytest.Config) -> list[str]:
    return [b.strip() for b in config.getoption("--portable-backends").split(",") if b.strip()]


def pytest_configure(config: pytest.Config) -> None:
    """Check the names once, before collection. Only registered names are read (no backend is
    imported), and only when the option is given: other test runs never import portable."""
    if config.getoption("--portable-backends") == DEFAULT:
        return
    from portable.backends import Target, registry

    known, names = registry.names(), _backends(config)
    if not names:
        raise pytest.UsageError(
            f"--portable-backends names no backend; registered backends: {', '.join(known)}"
        )
    unknown = [name for name in names if Target.parse(name).backend not in known]
    if unknown:
        raise pytest.UsageError(
            f"--portable-backends: unknown backend {', '.join(map(repr, unknown))}; "
            f"registered backends: {', '.join(known)}"
        )


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "portable_backend" in metafunc.fixturenames:
        metafunc.parametrize("portable_backend", _backends(metafunc.config), indirect=True)


@pytest.fixture
def portable_backend(request: pytest.FixtureRequest) -> str:
    from portable.backends import Target, get_backend
    from portable.errors import RegistryError

    name = request.param
    try:
        backend = get_backend(Target.parse(name).backend)
    except RegistryError as exc:  # registered, but its module does not import here
        pytest.skip(f"backend {name} cannot be loaded here: {exc}")
    ok, why = backend.can_execute_here()
    if not ok:
        pytest.skip(f"backend {name} cannot run here: {why}")
    return name
