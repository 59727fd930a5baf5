"""A job's configuration and the failures it meets before any rank starts (no processes here):
JobConfig and job.json as untrusted input, --kill's syntax, health verdicts, and bad data, plans,
outputs and engines, each a typed error naming the fix."""

from __future__ import annotations

import numpy as np
import pytest

from portable.errors import BackendError, DataError, JobError, PlanError
from portable.jobs.config import HealthPolicy, JobConfig
from portable.jobs.fault import parse_fault
from portable.jobs.health import Health
from portable.jobs.launch import _check_out
from portable.jobs.prepare import prepare_job, token_vocab
from tests.support.jobs import GPT, REPO, cli, plan, tokenize


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    return tokenize(REPO / "docs" / "parallelism.md", tmp_path_factory.mktemp("data") / "t.bin")


def _config(tokens, tmp_path, **fields):
    base = {"spec": GPT, "data": str(tokens), "steps": 4, "out": str(tmp_path / "run")}
    return JobConfig(**{**base, "batch": 8, "seq": 32, **fields})


# --------------------------------------------------------------------------- config


def test_job_json_round_trips_and_refuses_what_it_does_not_know(tokens, tmp_path):
    config = _config(tokens, tmp_path, trace_steps=(2, 3), health=HealthPolicy(spike_factor=3))
    assert JobConfig.from_json(config.to_json()) == config
    bad = [
        ("not a dict", []),
        ("unknown field", {**config.to_json(), "shell": "rm -rf /"}),
        ("a string step count", {**config.to_json(), "steps": "4"}),
        ("a boolean step count", {**config.to_json(), "steps": True}),
        ("null spec", {**config.to_json(), "spec": None}),
        ("unknown health field", {**config.to_json(), "health": {"on_fire": "stop"}}),
    ]
    for what, doc in bad:
        with pytest.raises(JobError):
            JobConfig.from_json(doc)
        del what


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"engine": "tpu"}, "engine 'tpu' is not one of"),
        ({"steps": 0}, "steps must be a positive integer"),
        ({"eval_every": 5}, "--eval-every needs --eval-data"),
        ({"data_dtype": "int8"}, "is not uint16 or uint32"),
        ({"timeout_s": -1.0}, "must be positive"),
        ({"health": None}, None),
    ],
)
def test_a_bad_config_is_refused_with_the_fix(tokens, tmp_path, fields, message):
    if message is None:
        with pytest.raises(JobError, match="is not a health action"):
            HealthPolicy(on_nonfinite="panic")
        return
    with pytest.raises(JobError, match=message):
        _config(tokens, tmp_path, **fields)


def test_the_fault_syntax():
    fault = parse_fault("1@120")
    assert (fault.rank, fault.step, fault.signal_name) == (1, 120, "KILL")
    assert parse_fault("0@3", "SIGSTOP").signal_name == "STOP"
    for text in ("1", "a@3", "1@x", "1@3:HUP", "1@0"):
        with pytest.raises(JobError):
            parse_fault(text)


def test_health_verdicts():
    health = Health(HealthPolicy(spike_factor=2.0, spike_window=3, on_spike="skip"))
    assert health.needs_snapshot
    assert [health.check(k, 4.0, {}) for k in range(1, 4)] == [None, None, None]
    assert "the loss 9 is 2.25x the mean 4" in health.check(4, 9.0, {})
    assert health.action("") == "skip"
    assert health.check(5, float("nan"), {}) == "the loss is nan"
    assert health.action("") == "stop"  # non-finite: the default action
    assert health.check(6, 4.0, {"grad_norm": float("inf")}) == "the gradient norm is inf"
    # with fp16 loss scaling the program skips such a step itself
    assert health.check(7, 4.0, {"grad_norm": float("inf"), "loss_scale": 1024.0}) is None


# --------------------------------------------------------------------------- bad input


def test_missing_short_and_wrong_dtype_data(tokens, tmp_path):
    with pytest.raises(DataError):
        prepare_job(_config(tokens, tmp_path, data=str(tmp_path / "nope.bin")))
    short = tmp_path / "short.bin"
    np.arange(100, dtype=np.uint16).tofile(short)
    with pytest.raises(DataError, match="batch"):
        prepare_job(_config(tokens, tmp_path, data=str(short)))
    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"\x01\x00\x02")
    with pytest.raises(DataError):
        prepare_job(_config(tokens, tmp_path, data=str(odd), data_dtype="uint32"))


def test_token_ids_outside_the_vocabulary_are_refused(tmp_path):
    text = tmp_path / "utf8.txt"
    text.write_text("naïve café " * 400)  # UTF-8 bytes above 127
    data = tokenize(text, tmp_path / "utf8.bin")
    with pytest.raises(DataError, match="outside the model's vocabulary of 128"):
        prepare_job(_config(data, tmp_path, data=str(data)))


def test_the_vocabulary_is_read_from_the_embedding_the_tokens_feed(tokens, tmp_path):
    prepared = prepare_job(_config(tokens, tmp_path))
    assert token_vocab(prepared.program) == 128
    assert prepared.batch == 8 and prepared.seq == 32 and prepared.flops_per_step


def test_a_plan_that_cannot_hold_the_job(tokens, tmp_path):
    with pytest.raises(PlanError):
        prepare_job(_config(tokens, tmp_path, plan=plan("dp2"), nproc=3))
    with pytest.raises(PlanError):  # 7 rows do not split over dp=2
        prepare_job(_config(tokens, tmp_path, plan=plan("dp2"), nproc=2, batch=7))


def test_an_earlier_job_is_not_overwritten(tokens, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("")
    with pytest.raises(JobError, match="--resume"):
        _check_out(run, _config(tokens, tmp_path))
    code, doc, err = cli("train", GPT, "--data", str(tokens), "--steps", "2", "--out", str(run))
    assert code == 3 and doc is not None and doc["error"]["type"] == "JobError"


def test_engines_say_where_their_boundary_is(monkeypatch):
    from portable.jobs import xla_engine

    monkeypatch.delenv(xla_engine.NEURON_STAND_IN, raising=False)
    with pytest.raises(BackendError, match="Neuron PJRT plugin"):
        xla_engine._devices("neuron")
    monkeypatch.setenv(xla_engine.NEURON_STAND_IN, "cpu")
    assert xla_engine._devices("neuron")[0].platform == "cpu"


def test_the_cuda_engine_without_a_gpu_names_the_engines_that_run_here(tokens, tmp_path):
    import torch

    from portable.jobs.prepare import read_job, write_job
    from portable.jobs.torch_engine import TorchEngine

    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is here: the cuda engine runs")
    prepared = prepare_job(_config(tokens, tmp_path, engine="cuda"))
    write_job(prepared, tmp_path / "run", {"epoch": 0.0})
    with pytest.raises(BackendError, match="--engine cpu"):
        TorchEngine(read_job(tmp_path / "run"), device_type="cuda", timeout_s=5)


def test_a_checkpoint_of_another_program_is_refused_before_any_rank_starts(tokens, tmp_path):
    import torch

    from portable.errors import CheckpointError
    from portable.jobs.checkpoint import CheckpointStore
    from portable.jobs.launch import _check_resumable

    store = CheckpointStore(tmp_path / "other" / "checkpoints")
    meta = {"identity": {"name": "TinyLlama.train_step", "structure_hash": "0" * 64}}
    store.save(3, {"w": torch.zeros(2)}, meta).wait()
    step = tmp_path / "other" / "checkpoints" / "step-3"
    prepared = prepare_job(_config(tokens, tmp_path, resume_from=str(step)))
    with pytest.raises(CheckpointError, match="a checkpoint of another program"):
        _check_resumable(prepared, tmp_path / "run")
