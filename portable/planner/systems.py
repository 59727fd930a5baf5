"""Accelerator systems for planning: per-format peaks, HBM, links by level, efficiency factors.

    h100 = planner.system("h100", devices=1024)          # 128 HGX H100 nodes
    h100.peak("bf16"), h100.hbm_bytes, h100.level_for(8).level   # 989e12, 80e9, "node"
    planner.system("trn3-gen2").devices                   # 144: one UltraServer

The numbers are data, not code: `systems.toml` beside this module holds every chip and system
with the source of each figure, as the vendor prints it ("900 GB/s" bidirectional, "3.2 Tbps"
per node), and this module converts them to the planner's units (FLOP/s, bytes, bytes/s per
device in one direction, seconds). The chip table is also what `portable.jobs.peaks.PEAKS`
reads, so a training job's MFU and the planner's use the same peaks. Efficiency factors are
per system and say whether they were calibrated or assumed (docs/planner.md, "Systems").
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import re
import tomllib
from collections.abc import Mapping
from importlib import resources
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, TypeGuard

from ..errors import PlannerError

if TYPE_CHECKING:
    import torch

__all__ = [
    "FORMATS",
    "LEVELS",
    "Chip",
    "Efficiency",
    "Link",
    "System",
    "canonical_format",
    "chips",
    "system",
    "systems",
]

# The number formats a peak can be given for, and the names they are also known by.
FORMATS = ("float32", "tfloat32", "bfloat16", "float16", "float8", "mxfp8", "mxfp4", "float4")
_ALIASES = {
    "fp32": "float32",
    "tf32": "tfloat32",
    "bf16": "bfloat16",
    "fp16": "float16",
    "half": "float16",
    "fp8": "float8",
    "float8_e4m3fn": "float8",
    "float8_e5m2": "float8",
    "fp4": "float4",
}
# Link levels, innermost first; "network" is the scale-out fabric (EFA, InfiniBand).
LEVELS = ("node", "ultraserver", "rack", "network")

_DATA = "systems.toml"
_SCHEMA = 1


def canonical_format(number_format: object) -> str:
    """The FORMATS name of `number_format`: a name or alias (`bf16`, `fp8`, `tf32`) or a torch
    dtype (`torch.float8_e4m3fn` reads as `float8`). Unknown names come back lower-cased."""
    name = str(number_format).strip().lower().removeprefix("torch.")
    return _ALIASES.get(name, name)


@dataclasses.dataclass(frozen=True)
class Chip:
    """One accelerator chip: dense peak FLOP/s per number format, HBM bytes and bandwidth."""

    name: str
    description: str
    peak_flops: Mapping[str, float]
    hbm_bytes: int
    hbm_bandwidth: float  # bytes/s
    source: str
    gemm_units: int = 1  # matmul output tiles per wave (systems.toml)
    gemm_tile: tuple[int, int] = (128, 128)


@dataclasses.dataclass(frozen=True)
class Link:
    """One level of a system's interconnect. `devices`: devices in one domain of the level (0
    for "network": the whole fleet); `bandwidth`: bytes/s per device in one direction (the
    published figure, halved when it was bidirectional, divided over the devices sharing it when
    it was a per-node total); `latency_s`: per collective step; `bandwidth_alt`: a conflicting
    published figure, where sources disagree."""

    level: str
    devices: int
    bandwidth: float
    latency_s: float
    source: str
    bandwidth_alt: float | None = None


@dataclasses.dataclass(frozen=True)
class Efficiency:
    """Fractions of the hardware's peaks that real kernels and collectives reach, per system.
    `calibrated` is True only where they were fitted to published measurements (`source`)."""

    matmul: float
    memory: float
    kernel_overhead_s: float
    link: Mapping[str, float]
    calibrated: bool
    source: str


@dataclasses.dataclass(frozen=True)
class System:
    """`devices` devices of one kind and their interconnect, for the planner (module doc)."""

    name: str
    chip: str
    devices: int
    peak_flops: Mapping[str, float]
    hbm_bytes: int
    hbm_bandwidth: float
    links: tuple[Link, ...]
    efficiency: Efficiency
    price_per_device_hour: float | None
    notes: tuple[str, ...]
    gemm_units: int = 1  # the chip's (systems.toml)
    gemm_tile: tuple[int, int] = (128, 128)

    def __hash__(self) -> int:  # the mappings are not hashable; equal systems share these
        return hash((self.name, self.chip, self.devices))

    def peak(self, number_format: str | torch.dtype) -> float:
        """Dense peak FLOP/s of one device in `number_format` (a FORMATS name, an alias such
        as `bf16` / `fp8`, or a torch dtype). PlannerError if the chip has no such rate."""
        key = canonical_format(number_format)
        if key not in self.peak_flops:
            asked = repr(key) if key == number_format else f"{number_format!r} ({key})"
            raise PlannerError(
                f"{self.name} ({self.chip}) has no peak rate for {asked}",
                fix=f"use one of {', '.join(self.peak_flops)}",
            )
        return self.peak_flops[key]

    def level_for(self, span: int) -> Link:
        """The innermost link whose domains hold `span` consecutive devices (a group of n ranks
        at stride s spans n*s) without a group straddling two domains: span <= domain size and
        span divides it; otherwise "network". PlannerError if span < 1 or span > devices."""
        if not (_is_int(span) and 1 <= span <= self.devices):
            raise PlannerError(
                f"a group spanning {span!r} devices does not fit {self.name} x {self.devices}",
                fix=f"give a span from 1 to {self.devices} (n ranks at stride s span n*s)",
            )
        for link in self.links[:-1]:
            if span <= link.devices and link.devices % span == 0:
                return link
        return self.links[-1]

    def link(self, level: str) -> Link:
        """The link of `level` ("node", "ultraserver", "rack", "network")."""
        for link in self.links:
            if link.level == level:
                return link
        raise PlannerError(
            f"{self.name} has no {level!r} link level",
            fix=f"use one of {', '.join(link.level for link in self.links)}",
        )

    @property
    def scale_up_devices(self) -> int:
        """Devices in one domain of the largest scale-up level (node, UltraServer or rack)."""
        return self.links[-2].devices if len(self.links) > 1 else 1

    def per_core(self, cores: int) -> System:
        """This system with one rank per NeuronCore (`cores` per chip share its peaks, HBM,
        bandwidth and links): how Neuron runs training on trn1 (two NeuronCore-v2 per chip,
        ranks = cores, as "TP32" on a 16-chip trn1.32xlarge)."""
        if not (_is_int(cores) and cores >= 1):
            raise PlannerError(f"cores={cores!r}", fix="cores per chip is a positive integer")
        links = tuple(
            dataclasses.replace(
                link,
                devices=link.devices * cores,
                bandwidth=link.bandwidth / cores,
                bandwidth_alt=None if link.bandwidth_alt is None else link.bandwidth_alt / cores,
            )
            for link in self.links
        )
        return dataclasses.replace(
            self,
            name=f"{self.name}/core",
            devices=self.devices * cores,
            peak_flops={k: v / cores for k, v in self.peak_flops.items()},
            hbm_bytes=self.hbm_bytes // cores,
            hbm_bandwidth=self.hbm_bandwidth / cores,
            links=links,
            price_per_device_hour=None
            if self.price_per_device_hour is None
            else self.price_per_device_hour / cores,
        )

    def with_devices(self, devices: int) -> System:
        """This system with `devices` devices (any count >= 1: a fleet need not fill its last
        node; the "network" level joins the domains)."""
        _check_devices(self.name, devices)
        return dataclasses.replace(self, devices=devices)


def systems() -> tuple[str, ...]:
    """The known system names."""
    return tuple(_catalog().systems)


def chips() -> Mapping[str, Chip]:
    """The chip table (name -> Chip) that systems and `portable.jobs.peaks` share."""
    return _catalog().chips


def system(name: str, devices: int | None = None) -> System:
    """The system `name` (`systems()` lists them) with `devices` devices; by default one domain
    of its largest scale-up level (8 for an H100 node, 72 for a GB200 NVL72 rack, 144 for a Trn3
    Gen2 UltraServer). PlannerError for an unknown name or devices < 1."""
    catalog = _catalog()
    key = str(name).strip().lower()
    if key not in catalog.systems:
        close = difflib.get_close_matches(key, catalog.systems, n=1)
        hint = f" (closest: {close[0]})" if close else ""
        raise PlannerError(
            f"unknown system {name!r}{hint}",
            fix=f"use one of {', '.join(catalog.systems)}",
        )
    base = catalog.systems[key]
    return base if devices is None else base.with_devices(devices)


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_devices(name: str, devices: object) -> None:
    if not (_is_int(devices) and devices >= 1):
        raise PlannerError(
            f"{name} needs a device count of at least 1, got {devices!r}",
            fix="pass devices=N with N >= 1 (or leave it out for one scale-up domain)",
        )


# --- loading systems.toml ------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Catalog:
    chips: Mapping[str, Chip]
    systems: Mapping[str, System]


@functools.cache
def _catalog() -> _Catalog:
    text = resources.files(__package__).joinpath(_DATA).read_text(encoding="utf-8")
    return _parse(tomllib.loads(text))


def _parse(data: Mapping[str, Any]) -> _Catalog:
    """The chips and systems of a parsed systems.toml, checked (PlannerError names the entry)."""
    if data.get("schema") != _SCHEMA:
        raise _bad("file", f"schema {data.get('schema')!r}, expected {_SCHEMA}")
    chips_ = {name: _chip(name, _table(data, "chips", name)) for name in _names(data, "chips")}
    systems_ = {
        name: _system(name, _table(data, "systems", name), chips_)
        for name in _names(data, "systems")
    }
    return _Catalog(MappingProxyType(chips_), MappingProxyType(systems_))


def _chip(name: str, t: Mapping[str, Any]) -> Chip:
    where = f"chips.{name}"
    tflops = _get(t, "peak_tflops", dict, where)
    unknown = sorted(set(tflops) - set(FORMATS))
    if unknown:
        raise _bad(where, f"unknown number formats {unknown}; known: {', '.join(FORMATS)}")
    peaks = {fmt: _positive(v, f"{where}.peak_tflops.{fmt}") * 1e12 for fmt, v in tflops.items()}
    return Chip(
        name=name,
        description=_get(t, "description", str, where),
        peak_flops=MappingProxyType(peaks),
        hbm_bytes=round(_quantity(_get(t, "hbm", str, where), _SIZES, f"{where}.hbm")),
        hbm_bandwidth=_quantity(_get(t, "hbm_bandwidth", str, where), _RATES, where),
        source=_get(t, "source", str, where),
        gemm_units=_count(t.get("gemm_units", 1), f"{where}.gemm_units"),
        gemm_tile=_tile(t.get("gemm_tile", [128, 128]), f"{where}.gemm_tile"),
    )


def _count(value: object, where: str) -> int:
    if not _is_int(value) or value < 1:
        raise _bad(where, f"{value!r} is not a positive integer")
    return value


def _tile(value: object, where: str) -> tuple[int, int]:
    if not isinstance(value, list) or len(value) != 2:
        raise _bad(where, f"{value!r} is not [rows, cols]")
    return _count(value[0], where), _count(value[1], where)


def _system(name: str, t: Mapping[str, Any], chips_: Mapping[str, Chip]) -> System:
    where = f"systems.{name}"
    chip_name = _get(t, "chip", str, where)
    if chip_name not in chips_:
        raise _bad(where, f"chip {chip_name!r} is not in [chips] ({', '.join(chips_)})")
    links = tuple(
        _link(f"{where}.links[{i}]", x) for i, x in enumerate(_get(t, "links", list, where))
    )
    _check_levels(where, links)
    chip = chips_[chip_name]
    price = t.get("price_per_device_hour")
    return System(
        name=name,
        chip=chip_name,
        devices=links[-2].devices if len(links) > 1 else 1,
        peak_flops=chip.peak_flops,
        hbm_bytes=chip.hbm_bytes,
        hbm_bandwidth=chip.hbm_bandwidth,
        links=links,
        efficiency=_efficiency(f"{where}.efficiency", _get(t, "efficiency", dict, where), links),
        price_per_device_hour=None if price is None else _positive(price, f"{where}.price"),
        notes=tuple(_get(t, "notes", list, where)),
        gemm_units=chip.gemm_units,
        gemm_tile=chip.gemm_tile,
    )


def _link(where: str, t: Mapping[str, Any]) -> Link:
    alt = t.get("alt")
    source = _get(t, "source", str, where)
    if alt is not None:
        source += f"; alternative figure: {_get(alt, 'source', str, where + '.alt')}"
    return Link(
        level=_get(t, "level", str, where),
        devices=_get(t, "devices", int, where),
        bandwidth=_link_rate(where, t),
        latency_s=_positive(t.get("latency_us"), f"{where}.latency_us") / 1e6,
        source=source,
        bandwidth_alt=None if alt is None else _link_rate(where + ".alt", alt),
    )


def _link_rate(where: str, t: Mapping[str, Any]) -> float:
    # the published figure -> bytes/s per device, one direction
    rate = _quantity(_get(t, "rate", str, where), _RATES, where)
    shared_by = t.get("shared_by", 1)
    if not (_is_int(shared_by) and shared_by >= 1):
        raise _bad(where, f"shared_by must be a device count >= 1, got {shared_by!r}")
    return rate / (2 if t.get("bidirectional", False) else 1) / shared_by


def _check_levels(where: str, links: tuple[Link, ...]) -> None:
    levels = [link.level for link in links]
    if not links or levels[-1] != "network" or links[-1].devices != 0:
        raise _bad(where, f"links must end with level 'network', devices = 0; got {levels}")
    known = [LEVELS.index(x) if x in LEVELS else -1 for x in levels]
    sizes = [link.devices for link in links[:-1]]
    if -1 in known or known != sorted(set(known)):
        raise _bad(where, f"link levels {levels}: each once, in the order {', '.join(LEVELS)}")
    if any(n < 1 for n in sizes) or any(b % a for a, b in zip(sizes, sizes[1:], strict=False)):
        raise _bad(where, f"domain sizes {sizes}: each >= 1 and a multiple of the one inside")


def _efficiency(where: str, t: Mapping[str, Any], links: tuple[Link, ...]) -> Efficiency:
    link = _get(t, "link", dict, where)
    levels = {x.level for x in links}
    if set(link) != levels:
        raise _bad(
            where, f"link factors for {sorted(link)}, the system's levels are {sorted(levels)}"
        )
    return Efficiency(
        matmul=_fraction(t.get("matmul"), f"{where}.matmul"),
        memory=_fraction(t.get("memory"), f"{where}.memory"),
        kernel_overhead_s=_positive(t.get("kernel_overhead_us"), f"{where}.kernel_overhead_us")
        / 1e6,
        link=MappingProxyType({k: _fraction(v, f"{where}.link.{k}") for k, v in link.items()}),
        calibrated=_get(t, "calibrated", bool, where),
        source=_get(t, "source", str, where),
    )


# "900 GB/s", "2,048 GiB/s", "3.2 Tbps", "400 Gb/s" -> bytes/s; "32 GiB", "80 GB" -> bytes
_RATES = {
    "GB/s": 1e9,
    "GiB/s": 2.0**30,
    "TB/s": 1e12,
    "Gb/s": 1e9 / 8,
    "Gbps": 1e9 / 8,
    "Tb/s": 1e12 / 8,
    "Tbps": 1e12 / 8,
}
_SIZES = {"GB": 1e9, "GiB": 2.0**30, "TB": 1e12}
_QUANTITY = re.compile(r"(\d{1,3}(?:,\d{3})+|\d+)(\.\d+)? ([A-Za-z/]+)")


def _quantity(text: str, units: Mapping[str, float], where: str) -> float:
    match = _QUANTITY.fullmatch(text.strip())
    if match is None or match[3] not in units:
        raise _bad(where, f"{text!r} is not a number and one of the units {', '.join(units)}")
    return float(match[1].replace(",", "") + (match[2] or "")) * units[match[3]]


def _names(data: Mapping[str, Any], section: str) -> list[str]:
    table = data.get(section)
    if not isinstance(table, dict) or not table:
        raise _bad("file", f"no [{section}] table")
    return list(table)


def _table(data: Mapping[str, Any], section: str, name: str) -> Mapping[str, Any]:
    return _get(data[section], name, dict, section)


def _get(t: Mapping[str, Any], key: str, kind: type | tuple[type, ...], where: str) -> Any:
    value = t.get(key)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        names = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise _bad(where, f"{key} must be a {names}, got {value!r}")
    return value


def _positive(value: Any, where: str) -> float:
    if not (isinstance(value, int | float) and not isinstance(value, bool)):
        raise _bad(where, f"expected a number, got {value!r}")
    if not (math.isfinite(value) and value > 0):
        raise _bad(where, f"expected a positive finite number, got {value!r}")
    return float(value)


def _fraction(value: Any, where: str) -> float:
    fraction = _positive(value, where)
    if fraction > 1:
        raise _bad(where, f"an efficiency factor is a fraction in (0, 1], got {value!r}")
    return fraction


def _bad(where: str, what: str) -> PlannerError:
    return PlannerError(
        f"{_DATA}: {where}: {what}",
        fix=f"correct portable/planner/{_DATA} (its header states the units and fields)",
    )
