"""Training jobs: a captured training step run on a fleet's engine with real data, checkpoints,
failure drills and measurements (docs/training-jobs.md).

    result = portable.jobs.train("examples/gpt.py:GPT", data="tokens.bin", steps=200, out="runs/gpt",
                                 nproc=2, plan="dp.json", ckpt_every=50)
    result.losses, result.summary["final_loss"]

`train` and `drill` take JobConfig's fields as keywords; SPEC is `file.py:Name`,
`pkg.module:Name`, an archive, or a `@portable` class / factory itself.
"""

from __future__ import annotations

from typing import Any

from ..capture import spec_of
from ..cli.load_spec import Source
from . import drill as _drill
from . import launch as _launch
from .config import HealthPolicy, JobConfig
from .fault import parse_fault
from .launch import TrainResult

__all__ = ["HealthPolicy", "JobConfig", "TrainResult", "drill", "train"]


def train(spec: Any, **fields: Any) -> TrainResult:
    """Run a training job (JobConfig's fields as keywords; `quiet=False` shows its output);
    returns a `TrainResult` (RUN's summary, metrics and events)."""
    quiet = fields.pop("quiet", True)
    config, source = _config(spec, fields)
    return _launch.train(config, quiet=quiet, source=source)


def drill(spec: Any, *, kill: str, signal: str = "KILL", **fields: Any) -> dict[str, Any]:
    """Run a failure drill (`kill="RANK@STEP"`, `signal` KILL or STOP); returns drill.json."""
    quiet = fields.pop("quiet", True)
    baseline = fields.pop("baseline", None)
    config, source = _config(spec, fields)
    if source is not None:
        raise TypeError("drill takes SPEC as text (file.py:Name): its baseline re-captures it")
    return _drill.drill(config, parse_fault(kill, signal), baseline=baseline, quiet=quiet)


def _config(spec: Any, fields: dict[str, Any]) -> tuple[JobConfig, Source | None]:
    if isinstance(spec, str):
        return JobConfig(spec=spec, **fields), None
    model_spec = spec_of(spec) if spec_of(spec) is not None else spec
    source = Source(getattr(model_spec, "name", "model"), spec=model_spec)
    return JobConfig(spec=source.text, **fields), source
