"""Bad input is a feature: each failure is a typed PortableError naming op, module, line and fix."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import portable
from portable import CaptureError, InputError, RegistryError


class Histograms(nn.Module):
    """Uses an op outside the opset (histc)."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x):
        return torch.histc(self.proj(x), bins=4)


class Branches(nn.Module):
    """Python control flow on a tensor value."""

    def forward(self, x):
        if x.sum() > 0:
            return x * 2
        return x - 1


class ReturnsInt(nn.Module):
    def forward(self, x):
        return x + 1, 3


class WithCache(nn.Module):
    def forward(self, x):
        return {"logits": x * 2, "past_key_values": x + 1}


class Dropout(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        return self.drop(self.proj(x))


def _message(exc_info) -> str:
    return str(exc_info.value)


def test_unsupported_op_names_op_module_line_and_fix():
    with pytest.raises(CaptureError) as info:
        portable.capture(Histograms(), (torch.randn(2, 4),))
    message = _message(info)
    assert "aten.histc" in message and "not in the portable opset" in message
    assert "test_errors.py:" in message and "torch.histc(self.proj(x)" in message
    assert "fix:" in message


def test_data_dependent_control_flow():
    with pytest.raises(CaptureError) as info:
        portable.capture(Branches(), (torch.randn(3),))
    message = _message(info)
    assert "data-dependent control flow" in message
    assert "test_errors.py:" in message and "if x.sum() > 0" in message
    assert "torch.where" in message  # the fix
    assert isinstance(info.value.__cause__, Exception)  # the torch error is kept as the cause


def test_non_tensor_output():
    with pytest.raises(CaptureError) as info:
        portable.capture(ReturnsInt(), (torch.randn(3),))
    assert "non-tensor" in _message(info) and "return tensors only" in _message(info)


def test_cache_output_refused():
    with pytest.raises(CaptureError) as info:
        portable.capture(WithCache(), (torch.randn(3),))
    assert "cache" in _message(info) and "use_cache=False" in _message(info)


class Noise(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x) + 0.1 * torch.rand_like(x)


def test_dropout_trains_but_torch_rng_noise_is_refused():
    batch = (torch.randn(2, 4), torch.randn(2, 4))
    step = portable.capture(
        Dropout(),
        batch,
        loss_fn=lambda m, x, y: ((m(x) - y) ** 2).mean(),
        optimizer=portable.optim.SGD(lr=0.1),
    )  # the program's generator draws the mask
    assert any(i.target == "rng.seed" for i in step.signature.inputs)
    with pytest.raises(CaptureError) as info:
        portable.capture(
            Noise(),
            batch,
            loss_fn=lambda m, x, y: ((m(x) - y) ** 2).mean(),
            optimizer=portable.optim.SGD(lr=0.1),
        )
    message = _message(info)
    assert "torch's RNG cannot be reproduced" in message and "portable.random" in message


def test_loss_must_be_scalar():
    with pytest.raises(CaptureError) as info:
        portable.capture(
            nn.Linear(4, 2),
            (torch.randn(3, 4),),
            loss_fn=lambda m, x: m(x),
            optimizer=portable.optim.SGD(lr=0.1),
        )
    assert "one scalar tensor" in _message(info) and "(3, 2)" in _message(info)


def test_training_needs_optimizer_and_unused_parameters_are_explained():
    with pytest.raises(CaptureError, match="needs an optimizer"):
        portable.capture(nn.Linear(4, 2), (torch.randn(3, 4),), loss_fn=lambda m, x: m(x).sum())

    class Unused(nn.Module):
        def __init__(self):
            super().__init__()
            self.used, self.unused = nn.Linear(4, 2), nn.Linear(4, 2)

        def forward(self, x):
            return self.used(x)

    with pytest.raises(CaptureError) as info:
        portable.capture(
            Unused(),
            (torch.randn(3, 4),),
            loss_fn=lambda m, x: m(x).sum(),
            optimizer=portable.optim.SGD(lr=0.1),
        )
    assert "requires_grad_(False)" in _message(info)


@pytest.fixture(scope="module")
def mlp_exe():
    model = nn.Sequential(nn.Linear(8, 4), nn.ReLU())
    return portable.compile(portable.capture(model, (torch.randn(2, 8),)))


def test_wrong_input_shape(mlp_exe):
    with pytest.raises(InputError) as info:
        mlp_exe(torch.randn(3, 8))
    message = _message(info)
    assert "wrong shape" in message and "float32[2x8]" in message and "float32[3x8]" in message


def test_wrong_input_dtype(mlp_exe):
    with pytest.raises(InputError) as info:
        mlp_exe(torch.randn(2, 8, dtype=torch.float64))
    assert "wrong dtype" in _message(info) and "float64[2x8]" in _message(info)


def test_wrong_input_count_and_type(mlp_exe):
    with pytest.raises(InputError, match="takes 1 input"):
        mlp_exe(torch.randn(2, 8), torch.randn(2, 8))
    with pytest.raises(InputError, match="must be a tensor"):
        mlp_exe([[1.0] * 8] * 2)


def test_unknown_backend_lists_known_ones():
    program = portable.capture(nn.Linear(2, 2), (torch.randn(1, 2),))
    with pytest.raises(RegistryError) as info:
        portable.compile(program, backend="tpu")
    assert "unknown backend 'tpu'" in _message(info) and "cpu" in _message(info)


def test_unknown_pass_lists_known_ones():
    from portable.passes import parse_pipeline

    with pytest.raises(RegistryError) as info:
        parse_pipeline("dce,fuse-everything")
    assert "fuse-everything" in _message(info) and "canonicalize" in _message(info)


def test_capture_rejects_non_module():
    with pytest.raises(CaptureError, match="needs an nn.Module"):
        portable.capture(lambda x: x, (torch.randn(2),))


def test_errors_share_one_hierarchy():
    for cls in (
        CaptureError,
        InputError,
        RegistryError,
        portable.ArchiveError,
        portable.VerifyError,
        portable.PassError,
        portable.BackendError,
        portable.LoweringError,
        portable.PlanError,
    ):
        assert issubclass(cls, portable.PortableError)
