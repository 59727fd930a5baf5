"""Package layout: `backends/` and `passes/` live at the top of the repo but install as
`portable.backends` and `portable.passes`, so site-packages gets no generic top-level names.
Metadata is in pyproject.toml; only the package mapping is computed here."""

from setuptools import find_packages, setup

_MAPPED = {"portable.backends": "backends", "portable.passes": "passes"}

packages = find_packages(include=["portable", "portable.*"])
for package, folder in _MAPPED.items():
    packages += [package] + [f"{package}.{sub}" for sub in find_packages(folder)]

setup(packages=packages, package_dir={"portable": "portable", **_MAPPED})
