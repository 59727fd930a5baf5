"""`portable.compile(program, "neuron")` (backends/neuron/run.py, devices.py): where JAX has neuron
devices it runs the neuron lowering on them; elsewhere it refuses naming what to do. Off
Trainium the devices are XLA:CPU's (PORTABLE_NEURON_STAND_IN=cpu), and the runs must equal the
xla backend's bit for bit: inference, training steps with state, and a per-rank program. A trn3
MX program (mx-quantize{format=e4m3,scale=emax}, bf16) runs its native GEMMs as the custom calls'
stand-ins there (chosen by the devices' platform), single-device, per-rank, and in the `neuron`
job engine, and equals the trn2 emulation bit for bit (CI on a one-layer GPT, whose step holds
every MX GEMM role; PORTABLE_SLOW=full on the example's two layers).

What only a Trn host shows: the plugin's neuronx-cc compile and NEFF cache, device numerics
(bf16/fp8, FP32 accumulation of integer ops), collectives across NeuronCores, and speed."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch

import portable
from portable.backends import get_backend
from portable.backends.neuron import devices as neuron_devices_module
from portable.backends.neuron.devices import NEURON_STAND_IN, neuron_devices, neuron_here
from portable.distributed.launch import per_rank_program
from portable.errors import BackendError
from portable.jobs.checkpoint import checkpoint_key
from tests.support import load_example, load_spec

pytest.importorskip("jax")

FULL = os.environ.get("PORTABLE_SLOW") == "full"

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_neuron_mx_native import _capture  # noqa: E402
from test_xla_spmd import tp_mlp_program  # noqa: E402


@pytest.fixture
def no_stand_in(monkeypatch):
    monkeypatch.delenv(NEURON_STAND_IN, raising=False)


@pytest.fixture
def stand_in(monkeypatch):
    monkeypatch.setenv(NEURON_STAND_IN, "cpu")


def _assert_equal(got, want) -> None:
    got, want = (got, want) if isinstance(want, tuple) else ((got,), (want,))
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and torch.equal(g, w)


# -- selection ------------------------------------------------------------------------------------


def test_without_the_plugin_neuron_refuses_and_says_what_to_do(no_stand_in):
    ok, why = get_backend("neuron").can_execute_here()
    assert not ok and "Trainium" in why and "libneuronxla" in why
    program = portable.capture_spec(load_spec("mlp"), training=False)
    with pytest.raises(BackendError, match="cannot run on this machine") as info:
        portable.compile(program, "neuron")
    assert "backends that run here" in str(info.value)
    written = portable.lower(program, "neuron")
    with pytest.raises(BackendError, match="neuron programs run on Trainium") as info:
        get_backend("neuron").executable(written)
    assert "jax-neuronx" in str(info.value) and NEURON_STAND_IN in str(info.value)


def test_the_plugin_is_looked_for_before_jax_is_asked(no_stand_in, monkeypatch):
    asked = []
    monkeypatch.setattr(neuron_devices_module, "neuron_devices", lambda: asked.append(1))
    assert neuron_here() == (
        False,
        "the Neuron PJRT plugin (libneuronxla, from jax-neuronx) is not installed",
    )
    assert asked == []  # no plugin: JAX's devices are not initialised for the question


def test_an_installed_plugin_is_asked_for_its_devices(no_stand_in, monkeypatch):
    # a plugin present but without devices (a non-Trn host with jax-neuronx) is still "not here"
    monkeypatch.setattr(neuron_devices_module, "_plugin_installed", lambda: True)
    ok, why = neuron_here()
    assert not ok and "no neuron devices" in why


def test_the_stand_in_switch_gives_cpu_devices_and_the_jobs_engine_shares_it(stand_in):
    from portable.jobs import xla_engine

    assert neuron_devices()[0].platform == "cpu"
    assert xla_engine._devices("neuron") == neuron_devices()
    assert xla_engine.NEURON_STAND_IN == NEURON_STAND_IN
    assert get_backend("neuron").can_execute_here() == (True, "")


# -- runs on the stand-in equal the xla backend's ------------------------------------------------


@pytest.mark.parametrize("stem", ["mlp", "gpt"])
def test_inference_equals_the_xla_backend_bit_for_bit(stand_in, stem):
    spec = load_spec(stem)
    program = portable.capture_spec(spec, training=False)
    got = portable.compile(program, "neuron")
    assert got.backend == "neuron"
    inputs = spec.inputs()
    _assert_equal(got(*inputs), portable.compile(program, "xla")(*inputs))


@pytest.mark.parametrize("stem", ["mlp", "gpt"])
def test_training_steps_with_state_equal_the_xla_backend_bit_for_bit(stand_in, stem):
    spec = load_spec(stem)
    program = portable.capture_spec(spec, training=True)
    # the optimizer's schedule computes in float64, which the neuron lowering computes in
    # float32 (fp64-downcast): xla runs that same program, as lowered
    (record,) = portable.lower(program, "neuron").payload.programs
    assert [f.code for f in record.findings] == ["fp64-downcast"]
    ours, theirs = portable.compile(program, "neuron"), portable.compile(record.program, "xla")
    plain = portable.compile(program, "xla")
    for _ in range(3):  # the state each step returns feeds the next
        batch = spec.batch()
        got, want, unlowered = ours(*batch), theirs(*batch), plain(*batch)
        assert torch.equal(got.loss, want.loss)
        assert set(got.state) == set(want.state)
        for key, value in want.state.items():
            assert torch.equal(got.state[key], value), key
            # against the float64 schedule: as tests/test_neuron.py, atol = 2% of lr (AdamW)
            torch.testing.assert_close(got.state[key], unlowered.state[key], rtol=1e-4, atol=2e-5)
    assert not all(torch.equal(ours.state[k], program.weights[k]) for k in ours.state)


def test_a_per_rank_program_runs_on_one_device_per_rank(stand_in):
    program, inputs, expected = tp_mlp_program()
    ours, theirs = portable.compile(program, "neuron"), portable.compile(program, "xla")
    x = inputs[-1]
    got, want = ours(x), theirs(x)
    _assert_equal(got, want)
    torch.testing.assert_close(got[0], expected[0], rtol=1e-5, atol=1e-5)


# -- MX programs on trn3: the custom calls' stand-ins on XLA:CPU ----------------------------------


def _plan(name: str):
    spec = importlib.util.spec_from_file_location("plans", REPO / "examples" / "plans.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, name)()


@pytest.fixture(scope="module")
def mx_step():
    """The GPT example's bf16 training step after mx-quantize{format=e4m3,scale=emax}; with one
    layer in CI (its GEMMs of every role, mm and addmm, are MX: the first and last stay high
    precision), the example's two under PORTABLE_SLOW=full."""
    gpt = load_example("gpt")
    model = None if FULL else gpt.GPT(gpt.GPTConfig(n_layer=1))
    return _capture("gpt", portable.Precision(compute="bfloat16"), model)


def _lowered(program, variant: str):
    """(the program lowered for neuron:`variant`, its MX GEMMs' lowerings)."""
    written = portable.lower(program, f"neuron:{variant}")
    (record,) = written.payload.programs
    assert record.mx_gemms
    return written, {g.lowering for g in record.mx_gemms}


def _executable(written):
    """What `portable.compile` runs of `written`, without lowering the program again."""
    return get_backend("neuron").executable(written)


def _assert_same_steps(ours, theirs, steps: int = 2) -> None:
    torch.manual_seed(0)
    spec = load_spec("gpt")
    for _ in range(steps):
        batch = spec.batch()
        assert torch.equal(ours(*batch).loss, theirs(*batch).loss)
    assert set(ours.state) == set(theirs.state)
    for key, value in theirs.state.items():
        assert torch.equal(ours.state[key], value), key


def test_the_run_rules_follow_the_devices_platform():
    from portable.backends.neuron import NeuronOptions
    from portable.backends.neuron.mx_native import native_mx_gemm
    from portable.backends.neuron.run import run_rules

    def impl(options, platform):
        return run_rules(options, platform)[native_mx_gemm].keywords["impl"]

    assert impl(NeuronOptions(), "neuron") == "custom-call"  # the plugin: neuronx-cc's calls
    assert impl(NeuronOptions(), "cpu") == "stand-in"  # XLA:CPU has no QuantizeMX
    assert impl(NeuronOptions(mx="stand-in"), "neuron") == "stand-in"


@pytest.mark.slow
def test_an_mx_training_step_runs_natively_on_the_stand_in_as_the_trn2_emulation(stand_in, mx_step):
    native, lowerings = _lowered(mx_step, "trn3")
    assert lowerings == {"native"}  # the custom calls, not the emulation
    emulated, lowerings = _lowered(mx_step, "trn2")
    assert lowerings == {"emulated"}
    _assert_same_steps(_executable(native), _executable(emulated), steps=3)


@pytest.mark.slow
def test_a_per_rank_mx_program_runs_its_native_gemms_on_one_device_per_rank(stand_in, mx_step):
    per_rank = per_rank_program(mx_step.replace(plan=_plan("dp2")))
    native, lowerings = _lowered(per_rank, "trn3")
    assert lowerings == {"native"}
    _assert_same_steps(_executable(native), portable.compile(per_rank, "neuron:trn2"))


@pytest.mark.slow
def test_the_neuron_job_engine_runs_the_trn3_lowering_and_records_it(stand_in, mx_step):
    from portable.jobs.config import JobConfig
    from portable.jobs.prepare import JobFiles
    from portable.jobs.xla_engine import XlaEngine

    per_rank = per_rank_program(mx_step.replace(plan=_plan("gpt_tp2")))
    config = JobConfig(spec="gpt", data="t.bin", steps=2, out="run", engine="neuron")
    engine = XlaEngine(JobFiles(config, {}, per_rank, None), platform="neuron")
    assert engine.lowering["target"] == "neuron:trn3"
    gemms = engine.lowering["mx_gemms"]
    assert gemms and {g["lowering"] for g in gemms} == {"native"}
    assert engine.device_kind == "cpu"  # the stand-in's devices (the plugin's: "neuron:trn3")
    emulated = portable.compile(per_rank, "neuron:trn2")
    torch.manual_seed(0)
    spec = load_spec("gpt")
    for _ in range(2):
        batch = spec.batch()
        assert engine.step(*batch).loss == emulated(*batch).loss.item()
    state = engine.checkpoint_state()
    for key, value in emulated.state.items():
        assert torch.equal(state[checkpoint_key(key)], value), key
