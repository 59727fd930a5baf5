"""pytest plugin: `--portable-backends=cpu,xla` parametrizes the `portable_backend` fixture.

A test that takes `portable_backend` runs once per listed backend; a backend that cannot run on
this machine is skipped with its reason, and an unknown name is a usage error."""

from __future__ import annotations

import pytest


def pytest_addoption(parser) -> None:
    group = parser.getgroup("portable")
    group.addoption(
        "--portable-backends",
        default="cpu",
        help="comma-separated backends for tests using the `portable_backend` fixture (default: cpu)",
    )


def _backends(config) -> list[str]:
    return [b.strip() for b in config.getoption("--portable-backends").split(",") if b.strip()]


def pytest_generate_tests(metafunc) -> None:
    if "portable_backend" in metafunc.fixturenames:
        metafunc.parametrize("portable_backend", _backends(metafunc.config), indirect=True)


@pytest.fixture
def portable_backend(request) -> str:
    from portable.backends import Target, get_backend
    from portable.errors import RegistryError

    name = request.param
    try:
        backend = get_backend(Target.parse(name).backend)
    except RegistryError as exc:
        raise pytest.UsageError(str(exc)) from exc
    ok, why = backend.can_execute_here()
    if not ok:
        pytest.skip(f"backend {name} cannot run here: {why}")
    return name
