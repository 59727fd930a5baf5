"""What a job does besides stepping: validation, target loss and cost, async checkpoints (same
bits as synchronous ones), keep-last-K, traces, metrics and `portable report`; health actions on
a non-finite loss; starting from a Hugging Face safetensors checkpoint, and reading a portable
checkpoint back with plain torch.distributed.checkpoint (no portable imported).
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from portable.jobs.checkpoint import CheckpointStore
from portable.jobs.data import Sampler, TokenFile
from tests.support.jobs import (
    GPT,
    GPT_SHAPE,
    LLAMA,
    REPO,
    cli,
    events,
    losses,
    records,
    tokenize,
    train,
)

METRIC_FIELDS = ("step", "loss", "lr", "grad_norm", "step_time_s", "tokens_per_s", "mfu")
METRIC_FIELDS += ("data_wait_s",)


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    return tokenize(REPO / "docs" / "parallelism.md", tmp_path_factory.mktemp("data") / "t.bin")


def _final_state(run):
    store = CheckpointStore(run / "checkpoints")
    latest = store.latest()
    assert latest is not None
    from torch.distributed.checkpoint import FileSystemReader  # noqa: F401 (DCP is the format)

    from portable.jobs.dcp_reader import read_metadata

    targets = {
        key: torch.zeros(tuple(entry.size), dtype=entry.properties.dtype)
        for key, entry in read_metadata(latest.path).state_dict_metadata.items()
    }
    store.load(latest, targets)
    return latest.step, targets


def test_eval_target_cost_async_checkpoints_traces_and_the_report(tokens, tmp_path):
    common = (*GPT_SHAPE, "--steps", "12", "--ckpt-every", "4")
    plain = tmp_path / "sync"
    train(GPT, tokens, plain, *common)
    run = tmp_path / "run"
    summary = train(
        GPT,
        tokens,
        run,
        *common,
        "--ckpt-async",
        "--keep",
        "2",
        "--eval-data",
        str(tokens),
        "--eval-every",
        "6",
        "--target-loss",
        "4.6",
        "--price-per-hour",
        "98.32",
        "--trace-steps",
        "3",
    )
    # async checkpoints hold the same bits as synchronous ones, and only the last 2 are kept
    assert losses(run) == losses(plain)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-12", "step-8"]
    step, ours = _final_state(run)
    assert step == 12 and all(torch.equal(v, _final_state(plain)[1][k]) for k, v in ours.items())
    saves = events(run, "checkpoint")
    assert [e["step"] for e in saves] == [4, 8, 12] and all(e["async_"] for e in saves)
    # every step's metrics, validation at 6 and 12, the target and the cost
    metrics = records(run / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(1, 13))
    assert all(field in m for m in metrics for field in METRIC_FIELDS)
    assert all(m["mfu"] is not None and 0 < m["mfu"] < 1 for m in metrics)
    evals = records(run / "eval.jsonl")
    assert [e["step"] for e in evals] == [6, 12] and evals[-1]["eval_loss"] < evals[0]["eval_loss"]
    assert summary["time_to_target_s"] is not None and summary["tokens_to_target"] == 6 * 256
    assert summary["cost_per_step"] > 0 and summary["cost_to_target"] > 0
    trace = json.loads((run / "traces" / "rank0-step3.json").read_text())
    assert trace["traceEvents"]
    code, doc, err = cli("report", str(run))
    assert code == 0, err
    assert (run / "report" / "summary.md").is_file() and (run / "report" / "loss.png").is_file()


def test_a_non_finite_loss_stops_the_job_or_rolls_back(tokens, tmp_path):
    # a token file whose windows are clean but one: the sentinel makes that batch's loss -inf
    spec = f"{REPO / 'tests' / 'fixtures' / 'nan_gpt.py'}:NanGPT"
    ids = np.fromfile(tokens, dtype=np.uint16).copy()
    sampler = Sampler(TokenFile.open(tokens), batch=8, seq=32, seed=0)
    bad_step = 7  # 1-based: the batch of data step 6
    window = int(sampler.windows(bad_step - 1)[0])
    ids[window * 32 + 3] = 127
    data = tmp_path / "bad.bin"
    ids.tofile(data)
    code, _, err = cli(
        "train", spec, "--data", str(data), "--out", str(tmp_path / "stop"), "--steps", "10"
    )
    assert code == 3 and f"step {bad_step}: the loss is -inf" in err
    run = tmp_path / "rollback"
    train(spec, data, run, "--steps", "10", "--ckpt-every", "3", "--on-nonfinite", "rollback")
    (health,) = events(run, "health")
    assert health["step"] == bad_step and health["action"] == "rollback"
    (rollback,) = events(run, "rollback")
    assert rollback["to"] == 6
    # steps 7-10 were redone from step-6 on the batches after the bad one: one line per step,
    # every loss finite (the failed step's record is the health event)
    metrics = records(run / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(1, 11))
    assert all(np.isfinite(m["loss"]) for m in metrics)


@pytest.mark.hf
def test_a_run_starts_from_hugging_face_safetensors_and_plain_dcp_reads_it_back(tokens, tmp_path):
    transformers = pytest.importorskip("transformers")
    sys.path.insert(0, str(REPO / "examples"))
    import hf_llama

    torch.manual_seed(7)
    model = hf_llama.TinyLlama.__portable__.build()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.01)  # weights unlike the spec's own
    hf_dir = tmp_path / "hf"
    model.save_pretrained(hf_dir, max_shard_size="100KB")  # sharded, with its index
    assert (hf_dir / "model.safetensors.index.json").is_file()
    run = tmp_path / "run"
    train(LLAMA, tokens, run, "--steps", "2", "--init-from", str(hf_dir))
    idx, targets = Sampler(TokenFile.open(tokens), batch=8, seq=32, seed=0).batch(0)
    with torch.no_grad():
        eager = hf_llama._lm_loss(model, idx, targets)
    assert abs(losses(run)[1] - float(eager)) <= 1e-5 * abs(float(eager))
    # plain torch.distributed.checkpoint into a fresh model's state_dict, portable blocked
    script = tmp_path / "plain.py"
    script.write_text(
        "import sys\n"
        "sys.modules['portable'] = None  # no portable in this process\n"
        "import torch, torch.distributed.checkpoint as dcp, transformers\n"
        f"model = transformers.LlamaForCausalLM(transformers.LlamaConfig.from_pretrained("
        f"{str(hf_dir)!r}))\n"
        "sd = model.state_dict()\n"
        "dcp.load(sd, checkpoint_id=sys.argv[1])\n"
        "model.load_state_dict(sd)\n"
        "torch.save({k: v.clone() for k, v in model.state_dict().items()}, sys.argv[2])\n"
    )
    out = tmp_path / "plain.pt"
    step = run / "checkpoints" / "step-2"
    done = subprocess.run(
        [sys.executable, str(script), str(step), str(out)], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    plain = torch.load(out, weights_only=True)
    _, ours = _final_state(run)
    assert set(plain) <= set(ours)
    assert all(torch.equal(plain[k], ours[k]) for k in plain)
    del transformers
