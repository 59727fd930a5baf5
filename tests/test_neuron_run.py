"""`portable.compile(program, "neuron")` (backends/neuron/run.py, devices.py): where JAX has neuron
devices it runs the neuron lowering on them; elsewhere it refuses naming what to do. Off
Trainium the devices are XLA:CPU's (PORTABLE_NEURON_STAND_IN=cpu), and the runs must equal the
xla backend's bit for bit: inference, training steps with state, and a per-rank program.

What only a Trn host shows: the plugin's neuronx-cc compile and NEFF cache, device numerics
(bf16/fp8, FP32 accumulation of integer ops), collectives across NeuronCores, and speed."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import portable
from portable.backends import get_backend
from portable.backends.neuron import devices as neuron_devices_module
from portable.backends.neuron.devices import NEURON_STAND_IN, neuron_devices, neuron_here
from portable.errors import BackendError
from tests.support import load_spec

pytest.importorskip("jax")

sys.path.insert(0, str(Path(__file__).resolve().parent))
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
