"""`portable report RUN`: a training run's curves as PNG files and its summary in markdown.

Reads what a job wrote into RUN (portable/jobs/run_files.py): metrics.jsonl, eval.jsonl,
events.jsonl, ranks/rank<r>.json, job.json and prediction.json (the planner's prediction of the
step, portable/jobs/prediction.py). They are files from elsewhere: each is read within a size
bound (regular files only, no symlinks), every value is type-checked before use, and a folder with neither job.json nor metrics.jsonl is not a run (JobError). The report is
written into `out` (default RUN/report/) atomically: the folder is complete or the previous one
stays; an `out` holding anything but report files is refused.

Files: loss.png (train and eval loss by step), lr.png, tokens_per_s.png, step_time_per_rank.png,
comm_histograms.png (when collectives were timed), summary.md and summary.json. Plots need
matplotlib (its Agg backend, no display); without it only the summaries are written, and
summary.md says so.

Steady state drops the first 2 steps (compilation, warm-up) when there are more than 2.
Percentages are of the steady steps' summed step time. `price_per_hour` is the price of all the
job's devices for one hour. Values job.json's summary holds (tokens, wall time, time / tokens /
cost to target) are taken from it; the others are computed from the per-step files. The
planner's prediction is compared per step component with the medians of the steady steps of the
job's last start (`predicted_vs_measured`; prediction.py says what each side is).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import re
import statistics
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from .. import atomic_dir
from ..errors import JobError
from ..limits import format_bytes
from ..safe_json import read_json
from .comm_stats import comm_from_json
from .metrics import read_jsonl
from .prediction import PREDICTION_FILE, comparison

__all__ = ["PLOTS", "REPORT_FILES", "Report", "make_report", "report", "summarize"]

PLOTS = ("loss.png", "lr.png", "tokens_per_s.png", "step_time_per_rank.png", "comm_histograms.png")
REPORT_FILES = frozenset({*PLOTS, "summary.md", "summary.json"})
WARMUP_STEPS = 2
MAX_RANKS = 4096
MAX_TABLE_ROWS = 50
_RANK_FILE = re.compile(r"rank(\d{1,6})\.json")
_FIX = "pass the RUN folder that `portable train --out RUN` wrote"
_NO_MATPLOTLIB = "plots need matplotlib: `pip install matplotlib`"


@dataclasses.dataclass(frozen=True)
class Report:
    """Where a report was written, and its summary (what summary.json holds)."""

    out: Path
    summary_md: Path
    summary: dict[str, Any]


def report(run: str | Path, *, out: str | Path | None = None) -> Path:
    """Write the report of `run` into `out` (default RUN/report/); returns summary.md's path."""
    return make_report(run, out=out).summary_md


def make_report(
    run: str | Path,
    *,
    out: str | Path | None = None,
    critical: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    on_stop: Callable[[Callable[[], None]], contextlib.AbstractContextManager] | None = None,
) -> Report:
    """`report`, returning the summary too; `critical` / `on_stop` as atomic_dir.staging's (the
    CLI's signal handling)."""
    files = _RunFiles.load(Path(run))
    summary = _summary(files)
    target = Path(out) if out is not None else files.root / "report"
    with atomic_dir.staging(target, check=_check_out, critical=critical, on_stop=on_stop) as tmp:
        summary["plots"], summary["plots_note"] = _plots(files, tmp)
        (tmp / "summary.json").write_text(json.dumps(summary, indent=2, allow_nan=False) + "\n")
        (tmp / "summary.md").write_text(_markdown(summary, files))
    return Report(target, target / "summary.md", summary)


def summarize(run: str | Path) -> dict[str, Any]:
    """The numbers of the report of `run` (no files written; `plots` not included)."""
    return _summary(_RunFiles.load(Path(run)))


def _check_out(out: Path) -> None:
    if not (out.exists() or out.is_symlink()):
        return
    if out.is_symlink() or not out.is_dir():
        raise JobError(f"report folder {out} exists and is not a folder", fix="pass another --out")
    foreign = sorted(p.name for p in out.iterdir() if p.name not in REPORT_FILES)
    if foreign:
        raise JobError(
            f"report folder {out} holds files a report does not write: {', '.join(foreign[:5])}",
            fix="pass --out a new folder or an earlier report's",
        )


# --- reading the run ------------------------------------------------------------------------


def _num(value: Any) -> float | None:
    """A finite number from a file, else None (bools are not numbers)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def _series(records: Iterable[Mapping[str, Any]], key: str) -> list[tuple[float, float]]:
    """(step, value) for each record with a numeric step and value."""
    out = []
    for r in records:
        step, value = _num(r.get("step")), _num(r.get(key))
        if step is not None and value is not None:
            out.append((step, value))
    return out


@dataclasses.dataclass(frozen=True)
class _RunFiles:
    root: Path
    metrics: list[dict[str, Any]]
    evals: list[dict[str, Any]]
    events: list[dict[str, Any]]
    ranks: list[dict[str, Any]]
    config: dict[str, Any]
    job_summary: dict[str, Any]
    prediction: dict[str, Any]
    planner: dict[str, Any]  # prediction.json: the planner's prediction of the step

    @staticmethod
    def load(root: Path) -> _RunFiles:
        if not root.is_dir():
            raise JobError(f"{root} is not a folder", fix=_FIX)
        job_path, metrics_path = root / "job.json", root / "metrics.jsonl"
        if not (_present(job_path) or _present(metrics_path)):
            raise JobError(
                f"{root} is not a training run: it has neither job.json nor metrics.jsonl",
                fix=_FIX,
            )
        job = _doc(read_json(job_path, JobError, fix=_FIX), job_path) if _present(job_path) else {}
        planner_path = root / PREDICTION_FILE
        planner = read_json(planner_path, JobError, fix=_FIX) if _present(planner_path) else {}
        return _RunFiles(
            root=root,
            metrics=_jsonl(metrics_path),
            evals=_jsonl(root / "eval.jsonl"),
            events=_jsonl(root / "events.jsonl"),
            ranks=_ranks(root / "ranks"),
            config=_doc(job.get("config", {}), job_path),
            job_summary=_doc(job.get("summary", {}), job_path),
            prediction=_doc(job.get("prediction", {}), job_path),
            planner=_doc(planner, planner_path),
        )


def _present(path: Path) -> bool:
    """Whether `path` exists; a symlink is refused (a run's files are never links)."""
    if path.is_symlink():
        raise JobError(f"{path} is a symbolic link; a run's files never are", fix=_FIX)
    return path.exists()


def _doc(value: Any, where: Path) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise JobError(f"{where}: expected an object, got {type(value).__name__}", fix=_FIX)
    return value


def _jsonl(path: Path) -> list[dict[str, Any]]:
    return read_jsonl(path) if _present(path) else []


def _ranks(folder: Path) -> list[dict[str, Any]]:
    if not _present(folder):
        return []
    if not folder.is_dir():
        raise JobError(f"{folder} is not a folder", fix=_FIX)
    names = sorted((int(m[1]), p) for p in folder.iterdir() if (m := _RANK_FILE.fullmatch(p.name)))
    if len(names) > MAX_RANKS:
        raise JobError(f"{folder} has {len(names)} rank files, over {MAX_RANKS}", fix=_FIX)
    docs = []
    for rank, path in names:
        doc = _doc(read_json(path, JobError, fix=_FIX) if _present(path) else {}, path)
        steps, times = doc.get("steps"), doc.get("step_time_s")
        if not (isinstance(steps, list) and isinstance(times, list) and len(steps) == len(times)):
            raise JobError(f"{path}: steps and step_time_s must be lists of one length", fix=_FIX)
        comm = comm_from_json(doc.get("comm"))
        docs.append({"rank": rank, "series": _pairs(steps, times), "comm": comm})
    return docs


def _pairs(xs: list[Any], ys: list[Any]) -> list[tuple[float, float]]:
    pairs = ((_num(x), _num(y)) for x, y in zip(xs, ys, strict=True))
    return [(x, y) for x, y in pairs if x is not None and y is not None]


# --- the numbers ----------------------------------------------------------------------------


def _first(*values: float | None) -> float | None:
    return next((v for v in values if v is not None), None)


def _mean(values: list[float]) -> float | None:
    return statistics.fmean(values) if values else None


def _summary(files: _RunFiles) -> dict[str, Any]:
    metrics, job = files.metrics, files.job_summary
    steady = metrics[WARMUP_STEPS:] if len(metrics) > WARMUP_STEPS else metrics
    values = {k: [v for _, v in _series(steady, k)] for k in _STEADY_KEYS}
    busy = sum(values["step_time_s"])
    losses = _series(metrics, "loss")
    steps = [s for s, _ in _series(metrics, "step_time_s")]
    tokens = _num(job.get("tokens"))
    if tokens is None:
        tokens = sum(
            (_num(r.get("tokens_per_s")) or 0.0) * (_num(r.get("step_time_s")) or 0.0)
            for r in metrics
        )
    times = [t for _, t in _series(metrics, "time_s")]
    wall = _first(_num(job.get("wall_s")), times[-1] if times else None)
    memory = [v for _, v in _series(metrics, "memory_bytes")]
    summary: dict[str, Any] = {
        "run": str(files.root),
        "steps": len(metrics),
        "first_step": int(steps[0]) if steps else None,
        "last_step": int(steps[-1]) if steps else None,
        "final_loss": losses[-1][1] if losses else None,
        "tokens": round(tokens),
        "wall_s": wall,
        "device": job.get("device") if isinstance(job.get("device"), dict) else None,
        "steady_steps": len(steady),
        **{f"mean_{k}": _mean(v) for k, v in values.items() if k in _MEANS},
        "data_wait_pct": 100 * sum(values["data_wait_s"]) / busy if busy else None,
        "exposed_comm_pct": 100 * sum(values["exposed_comm_s"]) / busy if busy else None,
        "comm_pct": 100 * sum(values["comm_s"]) / busy if busy else None,
        "peak_memory_bytes": int(max(memory)) if memory else None,
    }
    summary.update(_eval_and_target(files, summary))
    summary["events"] = _events(files.events)
    summary["comm"] = _comm_summary(files.ranks)
    summary["prediction"] = _prediction(files.prediction, summary)
    summary["predicted_vs_measured"] = (
        comparison(files.planner, files.metrics, warmup=WARMUP_STEPS) if files.planner else None
    )
    return summary


_MEANS = ("step_time_s", "tokens_per_s", "mfu")
_STEADY_KEYS = (*_MEANS, "data_wait_s", "comm_s", "exposed_comm_s")


def _setting(files: _RunFiles, key: str) -> float | None:
    value = _num(files.job_summary.get(key))
    return value if value is not None else _num(files.config.get(key))


def _eval_and_target(files: _RunFiles, summary: Mapping[str, Any]) -> dict[str, Any]:
    evals = [e for e in files.evals if _num(e.get("eval_loss")) is not None]
    best = min(evals, key=lambda e: e["eval_loss"], default=None)
    target, price = _setting(files, "target_loss"), _setting(files, "price_per_hour")
    hit = next((e for e in evals if target is not None and e["eval_loss"] <= target), None)
    job = files.job_summary
    time_to = _first(_num(job.get("time_to_target_s")), _num(hit.get("time_s")) if hit else None)
    tokens_to = _first(_num(job.get("tokens_to_target")), _num(hit.get("tokens")) if hit else None)
    per_s = price / 3600 if price is not None else None
    step_time = summary.get("mean_step_time_s")

    def cost(key: str, seconds: float | None) -> float | None:
        given = _num(job.get(key))
        if given is not None or per_s is None or seconds is None:
            return given
        return per_s * seconds

    return {
        "evals": len(evals),
        "final_eval_loss": evals[-1]["eval_loss"] if evals else None,
        "best_eval_loss": best["eval_loss"] if best else None,
        "best_eval_step": _num(best.get("step")) if best else None,
        "target_loss": target,
        "target_reached": None if target is None else (hit is not None or time_to is not None),
        "time_to_target_s": time_to,
        "tokens_to_target": tokens_to,
        "price_per_hour": price,
        "cost_per_step": cost("cost_per_step", step_time),
        "cost_to_target": cost("cost_to_target", time_to),
        "cost_total": cost("cost_total", summary.get("wall_s")),
    }


def _events(events: list[dict[str, Any]]) -> dict[str, Any]:
    counts: dict[str, int] = {}
    recovery = []
    for e in events:
        name = e.get("event")
        if not isinstance(name, str):
            continue
        counts[name[:64]] = counts.get(name[:64], 0) + 1
        if name not in ("checkpoint", "start", "done"):
            recovery.append({k: v for k, v in e.items() if isinstance(v, (str, int, float))})
    return {"counts": dict(sorted(counts.items())), "recovery": recovery[:MAX_TABLE_ROWS]}


def _comm_summary(ranks: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, Any]]]:
    """op -> `2^k` -> count over ranks, and the worst rank's p50 / p99 / max latency."""
    out: dict[str, dict[int, dict[str, Any]]] = {}
    for rank in ranks:
        for op, buckets in rank["comm"].items():
            for k, b in buckets.items():
                row = out.setdefault(op, {}).setdefault(k, {"count": 0, "ranks": 0})
                row["count"] += int(b["count"] or 0)
                row["ranks"] += 1
                for key in ("p50_s", "p99_s", "max_s"):
                    if b[key] is not None:
                        row[key] = max(row.get(key, 0.0), b[key])
    return {op: {f"2^{k}": bs[k] for k in sorted(bs)} for op, bs in out.items()}


def _exp(bucket: str) -> int:
    return int(bucket.split("^", 1)[1])


_MEASURED = {
    "step_time_s": "mean_step_time_s",
    "tokens_per_s": "mean_tokens_per_s",
    "mfu": "mean_mfu",
    "memory_bytes": "peak_memory_bytes",
    "peak_memory_bytes": "peak_memory_bytes",
    "exposed_comm_pct": "exposed_comm_pct",
    "time_to_target_s": "time_to_target_s",
}


def _prediction(prediction: dict[str, Any], summary: Mapping[str, Any]) -> list[dict[str, Any]]:
    """job.json's predicted figures beside the measured ones (`_MEASURED` maps the names)."""
    rows = []
    for key, value in sorted(prediction.items())[:MAX_TABLE_ROWS]:
        predicted, measured = _num(value), _num(summary.get(_MEASURED.get(key, key)))
        if predicted is not None:
            ratio = measured / predicted if measured is not None and predicted else None
            row = {"quantity": key[:64], "predicted": predicted, "measured": measured}
            rows.append({**row, "measured_over_predicted": ratio})
    return rows


# --- plots ----------------------------------------------------------------------------------


def _plots(files: _RunFiles, out: Path) -> tuple[list[str], str | None]:
    """Draw the PNGs into `out`; returns the names written and a note (why some are not)."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        return [], _NO_MATPLOTLIB
    written = []
    m = files.metrics
    evals = _series(files.evals, "eval_loss")
    curves = [
        ("loss.png", "loss", {"train": _series(m, "loss"), "eval": evals}),
        ("lr.png", "learning rate", {"lr": _series(m, "lr")}),
        ("tokens_per_s.png", "tokens / s", {"tokens/s": _series(m, "tokens_per_s")}),
    ]
    per_rank = {f"rank {r['rank']}": r["series"] for r in files.ranks}
    curves.append(
        ("step_time_per_rank.png", "step time (s)", per_rank or {"all": _series(m, "step_time_s")})
    )
    for name, ylabel, series in curves:
        fig = Figure(figsize=(7, 4), dpi=100)
        ax = fig.add_subplot()
        for label, points in series.items():
            style = "o--" if label == "eval" else "-"
            ax.plot([p[0] for p in points], [p[1] for p in points], style, label=label)
        ax.set(xlabel="step", ylabel=ylabel, title=ylabel)
        if len(series) > 1 and len(series) <= 16:
            ax.legend()
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(out / name)
        written.append(name)
    if any(r["comm"] for r in files.ranks):
        _comm_plot(Figure, files.ranks, out / "comm_histograms.png")
        written.append("comm_histograms.png")
    return written, None


def _comm_plot(figure: Any, ranks: list[dict[str, Any]], path: Path) -> None:
    """Per op: counts of collectives by latency (log2 us bins), stacked by message size."""
    hist: dict[str, dict[int, dict[int, float]]] = {}  # op -> size bucket -> latency bin -> n
    for rank in ranks:
        for op, buckets in rank["comm"].items():
            for k, b in buckets.items():
                bins = hist.setdefault(op, {}).setdefault(k, {})
                for j, n in b["latency_us"].items():
                    bins[j] = bins.get(j, 0.0) + n
    ops = sorted(hist)[:8]
    fig = figure(figsize=(7, 3 * len(ops)), dpi=100)
    for i, op in enumerate(ops):
        ax = fig.add_subplot(len(ops), 1, i + 1)
        seen = {j for bins in hist[op].values() for j in bins}
        lats = list(range(min(seen), max(seen) + 1)) if seen else []
        bottom = [0.0] * len(lats)
        for k in sorted(hist[op]):
            heights = [hist[op][k].get(j, 0.0) for j in lats]
            label = f"{format_bytes(2**k)}+"
            ax.bar([str(2**j) for j in lats], heights, bottom=bottom, label=label)
            bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
        ax.set(title=f"{op} latency", xlabel="latency from (us)", ylabel="collectives")
        ax.legend(title="message", fontsize="small")
    fig.tight_layout()
    fig.savefig(path)


# --- markdown -------------------------------------------------------------------------------


def _cell(value: Any) -> str:
    """A table cell: whole numbers as ints, others to 4 significant digits, text with | and
    newlines made safe."""
    if value is None:
        return "-"
    if isinstance(value, float):
        return str(int(value)) if value.is_integer() and abs(value) < 1e15 else f"{value:.4g}"
    text = _escape(value if isinstance(value, str) else json.dumps(value, default=str))
    return text if len(text) <= 80 else text[:77] + "..."


def _escape(text: str) -> str:
    """`text` on one markdown line: backslashes and | escaped, newlines made spaces."""
    return text.replace("\\", "\\\\").replace("|", "\\|").replace("\n", " ").replace("\r", " ")


def _table(header: list[str], rows: Iterable[Iterable[Any]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    lines += ["| " + " | ".join(_cell(v) for v in row) + " |" for row in rows]
    return [*lines, ""]


def _pct(value: float | None) -> str | None:
    return None if value is None else f"{value:.1f}%"


def _seconds(value: float | None) -> str | None:
    return None if value is None else f"{value:.4g} s"


def _markdown(s: Mapping[str, Any], files: _RunFiles) -> str:
    device = s["device"] or {}
    memory = s["peak_memory_bytes"]
    lines = [f"# Training run report: {_cell(files.root.name)}", ""]
    lines += _table(
        ["quantity", "value"],
        [
            ("steps recorded", s["steps"]),
            ("steps", f"{s['first_step']} .. {s['last_step']}" if s["steps"] else None),
            ("final loss", s["final_loss"]),
            ("tokens", s["tokens"]),
            ("wall time", _seconds(s["wall_s"])),
            (
                "device",
                f"{device.get('count', '?')} x {device.get('kind', '?')}" if device else None,
            ),
            ("peak memory", format_bytes(memory) if memory is not None else None),
        ],
    )
    dropped = WARMUP_STEPS if s["steps"] > WARMUP_STEPS else 0
    lines += [f"## Throughput (steady state: {s['steady_steps']} steps, {dropped} dropped)", ""]
    lines += _table(
        ["quantity", "value"],
        [
            ("mean step time", _seconds(s["mean_step_time_s"])),
            ("mean tokens/s", s["mean_tokens_per_s"]),
            ("mean MFU", _pct(100 * s["mean_mfu"]) if s["mean_mfu"] is not None else None),
            ("data wait", _pct(s["data_wait_pct"])),
            ("communication (issue to done)", _pct(s["comm_pct"])),
            ("exposed communication", _pct(s["exposed_comm_pct"])),
        ],
    )
    lines += ["## Evaluation and target", ""]
    lines += _table(
        ["quantity", "value"],
        [
            ("evaluations", s["evals"]),
            ("final eval loss", s["final_eval_loss"]),
            ("best eval loss", _best_eval(s)),
            ("target loss", s["target_loss"]),
            ("target reached", s["target_reached"]),
            ("time to target", _seconds(s["time_to_target_s"])),
            ("tokens to target", s["tokens_to_target"]),
            ("price per hour", s["price_per_hour"]),
            ("cost per step", s["cost_per_step"]),
            ("cost to target", s["cost_to_target"]),
            ("cost of the run", s["cost_total"]),
        ],
    )
    if s["comm"]:
        lines += ["## Collectives (count over ranks; latency of the slowest rank)", ""]
        rows = [
            (op, f"{format_bytes(2 ** _exp(b))}+", r["count"], r["ranks"], *_latencies(r))
            for op, buckets in s["comm"].items()
            for b, r in buckets.items()
        ]
        header = ["op", "message", "count", "ranks", "p50", "p99", "max"]
        lines += _table(header, rows[:MAX_TABLE_ROWS])
    events = s["events"]
    if events["counts"]:
        lines += ["## Events", ""]
        lines += _table(["event", "count"], events["counts"].items())
        if events["recovery"]:
            lines += ["Recovery and health events:", ""]
            lines += _table(["time (s)", "event", "details"], map(_event_row, events["recovery"]))
    if s["predicted_vs_measured"]:
        lines += _planner_section(s["predicted_vs_measured"])
    if s["prediction"]:
        lines += ["## Figures job.json predicts, vs measured", ""]
        rows = [tuple(r.values()) for r in s["prediction"]]
        lines += _table(["quantity", "predicted", "measured", "measured / predicted"], rows)
    if files.config:
        lines += ["## Configuration", ""]
        items = sorted(files.config.items())[:MAX_TABLE_ROWS]
        lines += _table(["setting", "value"], [(_cell(k), v) for k, v in items])
    lines += ["## Plots", ""]
    lines += [f"![{Path(p).stem}]({p})" for p in s.get("plots", [])]
    if s.get("plots_note"):
        lines += [f"No plots: {s['plots_note']}."]
    return "\n".join(lines) + "\n"


def _planner_section(c: Mapping[str, Any]) -> list[str]:
    """The planner's prediction beside the measured medians (prediction.comparison)."""
    lines = ["## Predicted vs measured, per step (the planner)", ""]
    if c["error"] is not None:
        return [*lines, f"No prediction: {_cell(c['error'])}.", ""]
    lines += [
        f"Planner: {_cell(c['system'])} x {_cell(c['devices'])}, {_cell(c['plan'])}, "
        f"{_cell(c['precision'])}, for the steps from {c['first_step']}. Measured: the median "
        f"of {c['steady_steps']} steady steps, from step {_cell(c['steady_from'])}.",
        "",
    ]
    rows = [
        (r["label"], *(_component(r["component"], r[k]) for k in ("predicted", "measured")))
        + (_ratio(r["measured_over_predicted"]),)
        for r in c["rows"]
    ]
    lines += _table(["component", "predicted", "measured", "measured / predicted"], rows)
    if c["assumptions"]:
        lines += ["Assumptions:", "", *(f"- {_escape(a)}" for a in c["assumptions"]), ""]
    return lines


def _component(key: str, value: float | None) -> str | None:
    if value is None:
        return None
    if key == "mfu":
        return f"{100 * value:.3g}%"
    if key == "tokens_per_s":
        return f"{value:,.0f}"
    return _seconds(value)


def _ratio(value: float | None) -> str | None:
    return None if value is None else f"{value:.3g}"


def _best_eval(s: Mapping[str, Any]) -> str | None:
    if s["best_eval_loss"] is None:
        return None
    return f"{_cell(s['best_eval_loss'])} at step {_cell(s['best_eval_step'])}"


def _latencies(row: Mapping[str, Any]) -> list[str | None]:
    return [_seconds(row.get(k)) for k in ("p50_s", "p99_s", "max_s")]


def _event_row(event: Mapping[str, Any]) -> tuple[Any, ...]:
    details = {k: v for k, v in event.items() if k not in ("time_s", "event")}
    return event.get("time_s"), event.get("event"), details or None
