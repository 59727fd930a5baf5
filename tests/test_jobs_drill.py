"""Failure drills (`portable drill`): a rank killed (SIGKILL) or frozen (SIGSTOP) mid-job, the job
restarted by torchrun's elastic agent from its last checkpoint, and the recovered run compared
bit for bit with the uninterrupted one (acceptance of the training-jobs issue).

CI runs both drills in a small form: GPT for 40 steps with checkpoints every 10, rank 1 killed at
step 24, and Llama for 30 steps; PORTABLE_SLOW=full runs them at the acceptance size (200 steps,
checkpoints every 50, rank 1 killed at step 120). The frozen-rank drill is small in both.
"""

from __future__ import annotations

import json

import pytest

from tests.support.jobs import FULL, GPT, GPT_SHAPE, LLAMA, REPO, cli, plan, records, tokenize

DRILL_FIELDS = (
    "detect_s",
    "restart_s",
    "reload_s",
    "recompile_s",
    "steps_lost",
    "recovery_s",
    "matches_uninterrupted",
)


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    return tokenize(REPO / "docs" / "parallelism.md", tmp_path_factory.mktemp("data") / "t.bin")


def _drill(spec, tokens, out, *args):
    code, doc, err = cli("drill", spec, "--data", str(tokens), "--out", str(out), *args)
    assert code == 0, err
    assert doc is not None
    written = json.loads((out / "drill.json").read_text())
    assert all(field in written for field in DRILL_FIELDS)
    return written


@pytest.mark.slow
def test_a_killed_rank_is_recovered_and_the_run_is_bit_identical(tokens, tmp_path):
    steps, every, kill = (200, 50, 120) if FULL else (40, 10, 24)
    report = _drill(
        GPT,
        tokens,
        tmp_path / "run",
        *GPT_SHAPE,
        "--steps",
        str(steps),
        "--ckpt-every",
        str(every),
        "--nproc",
        "2",
        "--plan",
        plan("dp2"),
        "--kill",
        f"1@{kill}",
        "--timeout",
        "60",
    )
    assert report["matches_uninterrupted"] is True
    assert report["losses_match"] and report["state_matches"]
    resumed = kill // every * every  # the last checkpoint before the kill: 100 (full), 20
    assert report["resumed_from_step"] == resumed
    assert report["steps_lost"] == kill - resumed - 1  # done after the checkpoint: 19 (full), 3
    assert 0 <= report["detect_s"] < 5  # torchrun's monitor sees a dead rank at once
    assert report["restart_s"] > 0 and report["reload_s"] > 0 and report["recompile_s"] > 0
    assert report["first_step_s"] <= report["recovery_s"]
    restarts = records(tmp_path / "run" / "restarts.jsonl")
    assert len(restarts) == 1  # one elastic restart, by torchrun


def test_a_frozen_rank_is_detected_within_the_timeout_and_recovered(tokens, tmp_path):
    timeout = 5.0
    report = _drill(
        GPT,
        tokens,
        tmp_path / "run",
        *GPT_SHAPE,
        "--steps",
        "20",
        "--ckpt-every",
        "5",
        "--nproc",
        "2",
        "--plan",
        plan("dp2"),
        "--kill",
        "1@13",
        "--signal",
        "STOP",
        "--timeout",
        str(timeout),
    )
    assert report["fault"]["signal"] == "STOP"
    # silent for the timeout (its own heartbeat, or its peer's collective), plus a poll or two
    assert timeout * 0.9 <= report["detect_s"] <= timeout + 3.0
    assert report["steps_lost"] == 2 and report["matches_uninterrupted"] is True
    hung = records(tmp_path / "run" / "hung.jsonl")
    if hung:  # the launcher found it silent (else rank 0's collective timed out first)
        assert hung[0]["rank"] == 1 and "stopped" in (hung[0]["state"] or "")


@pytest.mark.slow
@pytest.mark.hf
def test_a_hugging_face_llama_is_recovered_bit_identically(tokens, tmp_path):
    pytest.importorskip("transformers")
    steps, every, kill = ("200", "50", "1@120") if FULL else ("30", "10", "1@15")
    report = _drill(
        LLAMA,
        tokens,
        tmp_path / "run",
        "--steps",
        steps,
        "--ckpt-every",
        every,
        "--nproc",
        "2",
        "--plan",
        plan("dp2"),
        "--kill",
        kill,
        "--timeout",
        "60",
    )
    assert report["matches_uninterrupted"] is True
