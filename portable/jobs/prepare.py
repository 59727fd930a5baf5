"""What the launcher does before any rank starts: resolve the spec and plan, open the data,
capture the training step on a real batch, partition it, and write `RUN/.job/`.

    RUN/.job/job.json        {"format": "portable-job", "config": JobConfig, "identity": ...,
                              "batch", "seq", "vocab", "flops_per_step", "plan"}
    RUN/.job/train.portable  the per-rank training step (weights: the GLOBAL initial state)
    RUN/.job/eval.portable   the per-rank validation loss (with --eval-data)

Everything a rank reads comes from there; `.job` is replaced atomically on every start (a
resumed job may bring another plan or engine). The program's *identity* is the sha256 of its
structure without the plan and the weights (graph, signature, recipe): a checkpoint made under
any plan or engine from the same training definition carries it, and one of another program is
refused.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ..archive import load
from ..atomic_dir import staging
from ..capture import capture, capture_loss
from ..cli.load_spec import load_plan, resolve
from ..distributed.launch import per_rank_program
from ..errors import CaptureError, CheckpointError, JobError
from ..ir.content_hash import structure_bytes
from ..ir.plan import Plan
from ..ir.program import Program, ProgramKind
from ..optim import AdamW
from ..safe_json import read_json
from .config import JobConfig
from .data import Sampler, TokenFile, check_vocab
from .flops import program_flops

__all__ = [
    "JOB_DIR",
    "JOB_FORMAT",
    "JobFiles",
    "Prepared",
    "check_identity",
    "prepare_job",
    "read_job",
]

JOB_DIR = ".job"
JOB_FORMAT = "portable-job"
JOB_FORMAT_VERSION = 1
TRAIN = "train.portable"
EVAL = "eval.portable"


@dataclasses.dataclass(frozen=True)
class Prepared:
    """A job ready to launch: the global step, its per-rank form, and the facts ranks need."""

    config: JobConfig
    program: Program  # the global training step, with its plan
    per_rank: Program
    eval_per_rank: Program | None
    batch: int
    seq: int
    vocab: int | None
    flops_per_step: int | None

    @property
    def identity(self) -> dict[str, str]:
        return program_identity(self.program)

    @property
    def world(self) -> int:
        return self.program.plan.mesh.size if self.program.plan.mesh else 1


@dataclasses.dataclass(frozen=True)
class JobFiles:
    """`RUN/.job/` as a rank reads it back."""

    config: JobConfig
    doc: dict[str, Any]
    per_rank: Program
    eval_per_rank: Program | None


def program_identity(program: Program) -> dict[str, str]:
    """name and structure hash (no plan, no weights) of a training step."""

    bare = program.replace(plan=Plan(), spmd=None)
    return {
        "name": program.name,
        "structure_hash": hashlib.sha256(structure_bytes(bare)).hexdigest(),
    }


def check_identity(checkpoint: Any, identity: Mapping[str, str]) -> None:
    """CheckpointError unless `checkpoint` (a checkpoint.Checkpoint) was written by a program
    of this `identity` (under any plan or engine)."""
    theirs = checkpoint.meta.get("identity", {})
    if not isinstance(theirs, dict) or theirs.get("structure_hash") != identity["structure_hash"]:
        name = theirs.get("name") if isinstance(theirs, dict) else None
        raise CheckpointError(
            f"{checkpoint.path} is a checkpoint of another program ({name!r}), not of "
            f"{identity['name']!r}",
            fix="resume with the SPEC (and recipe, batch and seq) that wrote it, or start a new "
            "--out without --resume",
        )


def prepare_job(config: JobConfig, source: Any = None) -> Prepared:
    """Resolve (or take `source`: a `cli.load_spec.Source`), capture and partition (nothing is
    written; every failure is typed)."""

    source = resolve(config.spec) if source is None else source
    tokens = TokenFile.open(config.data, dtype=config.data_dtype)
    given_plan = load_plan(config.plan) if config.plan is not None else None
    if source.spec is not None:
        spec = source.spec
        if not spec.trainable:
            raise CaptureError(
                f"`{spec.name}` has no loss_fn, so it has no training step",
                fix="give @portable a loss_fn(model, idx, targets) and an example_batch",
            )
        batch, seq = _batch_shape(spec.batch(), spec.name, config)
        sampler = Sampler(tokens, batch=batch, seq=seq, seed=config.seed)
        example = sampler.batch(0)  # a real batch: the program is captured on the job's data
        model = spec.build()
        recipe = {"seed": config.seed, **spec.recipe}
        own_plan = spec.plan if isinstance(spec.plan, Plan) else Plan()
        program = capture(
            model,
            example,
            loss_fn=spec.loss_fn,
            optimizer=spec.optimizer or AdamW(lr=1e-3),
            name=f"{spec.name}.train_step",
            plan=given_plan or own_plan,  # a pipeline's micro-batches are the accumulation
            **recipe,
        )
        eval_program = None
        if config.eval_data is not None:
            eval_program = capture_loss(model, example, spec.loss_fn, name=f"{spec.name}.eval")
    else:
        program = source.program(training=True)
        batch, seq = _archive_shape(program, config)
        Sampler(tokens, batch=batch, seq=seq, seed=config.seed)  # enough tokens for a batch?
        eval_program = None
        if config.eval_data is not None:
            raise JobError(
                f"{config.spec} is an archive: it holds no validation loss program",
                fix="pass the model's SPEC (file.py:Name) to evaluate, or drop --eval-data",
            )
        own_plan = program.plan
    plan = given_plan or own_plan
    plan.check_world_size(_world(config, plan), f"--nproc {config.nproc}")
    plan.validate(program.tensor_shapes())
    program = program.replace(plan=plan)
    vocab = token_vocab(program)
    if vocab is not None:
        check_vocab(tokens, vocab)
        if config.eval_data is not None:
            check_vocab(TokenFile.open(config.eval_data, dtype=config.data_dtype), vocab)
    per_rank = per_rank_program(program)
    eval_per_rank = None
    if eval_program is not None and plan.pipeline is not None:
        raise JobError(
            "validation (--eval-data) is not run under a pipeline plan yet",
            fix="drop --eval-data, or evaluate under a plan without pipeline",
        )
    if eval_program is not None:
        eval_per_rank = per_rank_program(eval_program.replace(plan=plan))
        _check_same_state_layout(per_rank, eval_per_rank)
    return Prepared(config, program, per_rank, eval_per_rank, batch, seq, vocab, _flops(program))


def write_job(prepared: Prepared, run: Path, extra: Mapping[str, Any] | None = None) -> Path:
    """Write RUN/.job atomically (replacing a previous one), `extra` fields (the launcher's
    epoch, the checkpoint to resume from) in job.json; returns its path."""
    out = run / JOB_DIR
    doc = {
        "format": JOB_FORMAT,
        "format_version": JOB_FORMAT_VERSION,
        "config": prepared.config.to_json(),
        "identity": prepared.identity,
        "batch": prepared.batch,
        "seq": prepared.seq,
        "vocab": prepared.vocab,
        "flops_per_step": prepared.flops_per_step,
        "plan": prepared.program.plan.to_json(),
        "world": prepared.world,
        **(extra or {}),
    }
    run.mkdir(parents=True, exist_ok=True)
    with staging(out) as tmp:
        prepared.per_rank.save(tmp / TRAIN)
        if prepared.eval_per_rank is not None:
            prepared.eval_per_rank.save(tmp / EVAL)
        (tmp / "job.json").write_text(json.dumps(doc, indent=2) + "\n")
    return out


def read_job(run: Path) -> JobFiles:
    """RUN/.job as written by `write_job` (JobError when it is not one)."""

    folder = run / JOB_DIR
    doc = read_json(folder / "job.json", JobError, fix="start the job with portable train")
    if not isinstance(doc, dict) or doc.get("format") != JOB_FORMAT:
        raise JobError(f"{folder / 'job.json'} is not a portable job file")
    if doc.get("format_version") != JOB_FORMAT_VERSION:
        raise JobError(
            f"{folder / 'job.json'} has format_version {doc.get('format_version')!r}",
            fix=f"this portable reads version {JOB_FORMAT_VERSION}: restart with portable train",
        )
    config = JobConfig.from_json(doc.get("config"))
    per_rank = load(folder / TRAIN)
    if per_rank.kind is not ProgramKind.TRAINING_STEP:
        raise JobError(f"{folder / TRAIN} is not a training step")
    eval_per_rank = load(folder / EVAL) if (folder / EVAL).is_dir() else None
    return JobFiles(config, doc, per_rank, eval_per_rank)


# --------------------------------------------------------------------------- helpers


def _world(config: JobConfig, plan: Plan) -> int:
    """The processes the engine runs: --nproc on torch.distributed; the mesh's devices under one
    controller on xla/neuron (which runs one process)."""
    if config.engine in ("xla", "neuron"):
        return plan.mesh.size if plan.mesh else 1
    return config.nproc


def _batch_shape(example: tuple[Any, ...], name: str, config: JobConfig) -> tuple[int, int]:
    """(global batch, seq) of a spec whose batch is (idx, targets) token tensors."""
    tokens = len(example) == 2 and all(
        isinstance(t, torch.Tensor) and t.dim() == 2 and not t.is_floating_point() for t in example
    )
    if not tokens or example[0].shape != example[1].shape:
        got = ", ".join(
            f"{t.dtype}{list(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            for t in example
        )
        raise JobError(
            f"`{name}`'s example batch is ({got}): portable train feeds (idx, targets) token "
            "batches of shape [batch, seq]",
            fix="give @portable a loss_fn(model, idx, targets) and an example_batch of two "
            "integer [batch, seq] tensors",
        )
    batch, seq = example[0].shape
    return config.batch or int(batch), config.seq or int(seq)


def _archive_shape(program: Program, config: JobConfig) -> tuple[int, int]:
    users = program.signature.user_inputs
    shapes = [tuple(u.spec.shape) for u in users]
    if len(users) != 2 or len(shapes[0]) != 2 or shapes[0] != shapes[1]:
        raise JobError(
            f"{program.name} takes {[str(u.spec) for u in users]}: portable train feeds "
            "(idx, targets) token batches of shape [batch, seq]",
            fix="capture the training step with loss_fn(model, idx, targets)",
        )
    batch, seq = (int(d) for d in shapes[0])
    if (config.batch or batch) != batch or (config.seq or seq) != seq:
        raise JobError(
            f"{config.spec} was captured for batches of [{batch}, {seq}]; --batch/--seq "
            "cannot change an archive",
            fix="pass the model's SPEC to capture another batch shape, or drop --batch/--seq",
        )
    return batch, seq


def token_vocab(program: Program) -> int | None:
    """The smallest vocabulary an embedding reads a user input with (None: no such lookup)."""
    users = {u.name for u in program.signature.user_inputs}
    shapes = {i.name: i.spec.shape for i in program.signature.inputs}
    sizes = []
    for node in program.graph_module.graph.nodes:
        if node.op != "call_function" or str(node.target) != "aten.embedding.default":
            continue
        weight, index = node.args[0], node.args[1]
        if getattr(index, "op", None) == "placeholder" and index.name in users:
            rows = shapes.get(getattr(weight, "name", ""), (None,))[0]
            if isinstance(rows, int):
                sizes.append(rows)
    return min(sizes) if sizes else None


def _check_same_state_layout(train: Program, evaluation: Program) -> None:
    """The validation program reads the training state as it is laid out on each rank."""
    train_layout, eval_layout = train.spmd, evaluation.spmd
    assert train_layout is not None and eval_layout is not None  # per_rank_program sets them
    for spec in evaluation.signature.state_inputs:
        match = [s for s in train.signature.state_inputs if s.key == spec.key]
        if not match:
            raise JobError(f"the validation loss reads `{spec.key}`, which the step does not hold")
        ours = eval_layout.input(spec.name).sharding
        theirs = train_layout.input(match[0].name).sharding
        if ours != theirs:
            raise JobError(
                f"the plan lays `{spec.key}` out as {theirs} in the training step but as {ours} "
                "in the validation loss",
                fix="evaluate under a plan that shards weights the same way in both, or drop "
                "--eval-data",
            )


def _flops(program: Program) -> int | None:
    """Model FLOPs of one step of the global program (None when they cannot be counted)."""

    try:
        return int(program_flops(program).total)
    except Exception:  # a count is a measurement aid: the job runs without it
        return None
