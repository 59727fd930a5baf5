"""Resume and reshard (the move between fleets): a DP=2 job's checkpoint continued as one
process, as TP=2, as FSDP=2 (DCP's resharding load), on the xla engine and on the neuron
engine's stand-in, each compared with the uninterrupted DP=2 run on the same global batches; and
`--resume` of the same plan on cpu, which continues bit for bit (here past a truncated newest
checkpoint, which is skipped for the complete one before it).
"""

from __future__ import annotations

import shutil

import pytest

from tests.support.jobs import (
    FULL,
    GPT,
    GPT_SHAPE,
    REPO,
    events,
    losses,
    plan,
    tokenize,
    train,
    worst_relative,
)

STEPS, CHECKPOINT = 40, 20


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    return tokenize(REPO / "docs" / "parallelism.md", tmp_path_factory.mktemp("data") / "t.bin")


@pytest.fixture(scope="module")
def reference(tokens, tmp_path_factory):
    """The uninterrupted DP=2 run: 40 steps, checkpoints at 20 and 40."""
    run = tmp_path_factory.mktemp("dp2") / "run"
    train(
        GPT,
        tokens,
        run,
        *GPT_SHAPE,
        "--steps",
        str(STEPS),
        "--ckpt-every",
        str(CHECKPOINT),
        "--nproc",
        "2",
        "--plan",
        plan("dp2"),
    )
    return run


def _continue(tokens, reference, out, *args):
    step = reference / "checkpoints" / f"step-{CHECKPOINT}"
    train(GPT, tokens, out, *GPT_SHAPE, "--steps", str(STEPS), "--resume-from", str(step), *args)
    ours = losses(out)
    assert sorted(ours) == list(range(CHECKPOINT + 1, STEPS + 1))  # 20 steps on from the checkpoint
    return ours


RESHARDS = {
    "one process": ("--nproc", "1"),
    "tp2": ("--nproc", "2", "--plan", plan("gpt_tp2")),
    "fsdp2": ("--nproc", "2", "--plan", plan("fsdp2")),
}
if FULL:
    RESHARDS["dp2 x tp2"] = ("--nproc", "4", "--plan", plan("gpt_dp2_tp2"))


@pytest.mark.parametrize("target", list(RESHARDS))
def test_a_dp2_checkpoint_continues_under_another_plan(target, tokens, reference, tmp_path):
    ours = _continue(tokens, reference, tmp_path / "run", *RESHARDS[target])
    assert worst_relative(ours, losses(reference)) <= 1e-6


def test_a_cpu_checkpoint_continues_on_the_xla_engine(tokens, reference, tmp_path):
    ours = _continue(tokens, reference, tmp_path / "run", "--engine", "xla", "--plan", plan("dp2"))
    assert worst_relative(ours, losses(reference)) <= 1e-5  # the xla parity tolerance


def test_the_neuron_engine_runs_the_neuron_lowering_on_its_stand_in(
    tokens, reference, tmp_path, monkeypatch
):
    # off Trainium the neuron engine runs the lowering `--target neuron` writes on XLA:CPU
    monkeypatch.setenv("PORTABLE_NEURON_STAND_IN", "cpu")
    ours = _continue(tokens, reference, tmp_path / "run", "--engine", "neuron")
    assert worst_relative(ours, losses(reference)) <= 1e-5
    # the job names no Trainium generation: the backend's default, recorded where the job starts
    (start,) = events(tmp_path / "run", "start")
    assert start["lowering"] == {"target": "neuron:trn3", "mx_gemms": []}  # fp32: no MX GEMMs


def test_resume_skips_a_truncated_checkpoint_and_continues_bit_for_bit(tokens, reference, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(reference, run)
    newest = run / "checkpoints" / f"step-{STEPS}"
    shard = sorted(newest.glob("*.distcp"))[0]
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])  # a torn write
    train(
        GPT,
        tokens,
        run,
        *GPT_SHAPE,
        "--steps",
        str(STEPS),
        "--resume",
        "--nproc",
        "2",
        "--plan",
        plan("dp2"),
    )
    skipped = events(run, "checkpoint_skipped")
    assert skipped and str(newest) in skipped[0]["path"]
    assert events(run, "resume")[-1]["step"] == CHECKPOINT  # the complete one before it
    assert losses(run) == losses(reference)  # same plan, same engine: bit-exact continuation
