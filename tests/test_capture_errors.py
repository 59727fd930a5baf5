"""Capture refuses what it cannot capture, at the earliest point, by name, with the fix.

Each case here once reached users raw (an untyped exception, exit 70) or was silently dropped
(issue 13, items 11, 12, 17, 19): a `@portable` factory that raises, sparse and meta tensors,
mixed-dtype operands that only fail at run time, a criterion passed as `loss_fn`, learning-rate
schedulers, optimizer state and flags, `torch.autocast`, and the decorator's own entry points.
"""

from __future__ import annotations

import copy
import textwrap

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import portable
from portable import CaptureError, InputError, VerifyError
from portable.cli import ExitCode, main
from portable.errors import AbstractProgramError
from portable.testing import check_parity

HERE = __file__


def _line_of(text: str) -> int:
    """The line number of the first line of this file containing `text`."""
    with open(HERE) as f:
        return next(i for i, line in enumerate(f, 1) if text in line)


class TwoLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.fc2 = nn.Linear(8, 3)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


# item 11: a @portable factory (or example-input function) that raises -----------------------------


@portable.portable(example_inputs=lambda: (torch.randn(2, 4),))
def broken_factory():
    raise ValueError("no such checkpoint: weights.bin")  # the factory's own bug


@portable.portable(example_inputs=lambda: (torch.randn(2, 4) @ torch.randn(3, 4),))
def broken_inputs():
    return TwoLayer()


def test_a_factory_that_raises_is_a_capture_error_at_its_line():
    with pytest.raises(CaptureError) as info:
        portable.capture_spec(broken_factory)
    message = str(info.value)
    assert "building `broken_factory` raised ValueError: no such checkpoint" in message
    assert f"{HERE}:{_line_of('the factory' + chr(39) + 's own bug')}" in message
    assert "fix:" in message
    assert isinstance(info.value.__cause__, ValueError)


def test_example_inputs_that_raise_are_a_capture_error():
    with pytest.raises(CaptureError) as info:
        portable.capture_spec(broken_inputs)
    message = str(info.value)
    assert "example_inputs of `broken_inputs` raised RuntimeError" in message
    assert f"{HERE}:{_line_of('def broken_inputs') - 1}" in message


def test_a_factory_failing_inside_a_library_points_at_the_factory():
    transformers = pytest.importorskip("transformers")

    @portable.portable(example_inputs=lambda: (torch.randint(0, 8, (1, 4)),))
    def hf_model():
        return transformers.LlamaForCausalLM(None)  # no config: fails inside transformers

    with pytest.raises(CaptureError) as info:
        portable.capture_spec(hf_model)
    assert f"{HERE}:{_line_of('no config: fails inside transformers')}" in str(info.value)


def test_cli_reports_a_raising_factory_as_a_user_error(tmp_path, capsys):
    model_file = tmp_path / "models.py"
    model_file.write_text(
        textwrap.dedent(
            """
            import torch
            import portable

            @portable(example_inputs=lambda: (torch.randn(2, 4),))
            def model():
                return torch.nn.Linear(4, 2, bias="yes", nonsense=1)
            """
        )
    )
    code = main(["lower", f"{model_file}:model", "-t", "cpu", "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert code == ExitCode.USER_ERROR, err
    assert "building `model` raised TypeError" in err and f"{model_file}:7" in err
    assert "Traceback" not in err


# item 11: sparse and meta tensors -----------------------------------------------------------------


def test_sparse_input_is_refused_at_capture_by_name():
    sparse = torch.randn(2, 4).to_sparse()
    with pytest.raises(CaptureError) as info:
        portable.capture(TwoLayer(), (sparse,))
    message = str(info.value)
    assert "example input 0 is a sparse tensor (torch.sparse_coo)" in message
    assert ".to_dense()" in message


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
def test_sparse_kwarg_and_buffer_are_refused():
    with pytest.raises(CaptureError, match=r"example input `x` is a sparse tensor"):
        portable.capture(TwoLayer(), (), kwargs={"x": torch.randn(2, 4).to_sparse_csr()})
    model = TwoLayer()
    model.register_buffer("table", torch.eye(4).to_sparse())
    with pytest.raises(CaptureError, match=r"buffer `table` of TwoLayer is a sparse tensor"):
        portable.capture(model, (torch.randn(2, 4),))


def test_meta_device_model_captures_abstractly_and_refuses_to_run_with_the_fix():
    with torch.device("meta"):
        model = TwoLayer()
    program = portable.capture(model, (torch.randn(2, 4),))  # tests/test_abstract_capture.py
    assert program.abstract
    with pytest.raises(AbstractProgramError) as info:
        portable.compile(program, backend="cpu")
    message = str(info.value)
    assert "program `TwoLayer` is abstract" in message and "fc1.weight" in message
    assert "to_empty" in message and "load_state_dict" in message


def test_executable_refuses_sparse_and_meta_inputs():
    run = portable.compile(portable.capture(TwoLayer(), (torch.randn(2, 4),)), backend="cpu")
    with pytest.raises(InputError, match=r"input `x` of TwoLayer is a sparse tensor"):
        run(torch.randn(2, 4).to_sparse())
    with pytest.raises(InputError, match=r"input `x` of TwoLayer is on the meta device"):
        run(torch.randn(2, 4, device="meta"))


# item 11: mixed-dtype operands that fake kernels accept and eager kernels refuse ------------------


def test_float16_input_into_float32_linear_is_refused_at_capture_at_the_users_line():
    with pytest.raises(CaptureError) as info:
        portable.capture(TwoLayer(), (torch.randn(2, 4, dtype=torch.float16),))
    message = str(info.value)
    assert "aten.addmm.default needs one dtype for self, mat1, mat2" in message
    assert "mat1 is torch.float16, mat2 is torch.float32" in message
    assert "module `fc1`" in message
    assert f"{HERE}:{_line_of('return self.fc2(torch.tanh(self.fc1(x)))')}" in message


def _sample(op_name: str):
    """Small eager arguments for each op of the same-dtype table (all float32)."""
    r = torch.randn
    idx = torch.tensor([0, 1])
    conv = ([1, 1], [0, 0], [1, 1], False, [0, 0], 1)
    return {
        "aten.mm.default": (r(2, 4), r(4, 3)),
        "aten.bmm.default": (r(1, 2, 4), r(1, 4, 3)),
        "aten.addmm.default": (r(3), r(2, 4), r(4, 3)),
        "aten.convolution.default": (r(1, 2, 5, 5), r(3, 2, 3, 3), None, *conv),
        "aten.convolution_backward.default": (
            r(1, 3, 3, 3),
            r(1, 2, 5, 5),
            r(3, 2, 3, 3),
            [3],
            *conv,
            [True, True, True],
        ),
        "aten.index_put.default": (r(4), [torch.tensor([0])], r(1)),
        "aten.nll_loss_forward.default": (r(2, 4), idx, r(4), 1, -100),
        "aten.nll_loss_backward.default": (r(()), r(2, 4), idx, r(4), 1, -100, r(())),
        "aten._softmax_backward_data.default": (r(4), r(4), 0, torch.float32),
        "aten._log_softmax_backward_data.default": (r(4), r(4), 0, torch.float32),
        "aten.native_layer_norm_backward.default": (
            r(2, 4),
            r(2, 4),
            [4],
            r(2, 1),
            r(2, 1),
            None,
            None,
            [True, False, False],
        ),
        "aten.native_batch_norm_backward.default": (
            r(2, 3),
            r(2, 3),
            r(3),
            r(3),
            r(3),
            r(3),
            r(3),
            False,
            1e-5,
            [True, True, True],
        ),
        "aten.avg_pool2d_backward.default": (
            r(1, 1, 2, 2),
            r(1, 1, 4, 4),
            [2, 2],
            [2, 2],
            [0, 0],
            False,
            True,
            None,
        ),
        "portable.attention.default": (r(1, 1, 2, 4), r(1, 1, 2, 4), r(1, 1, 2, 4)),
        "portable.attention_backward.default": (
            r(1, 1, 2, 4),
            r(1, 1, 2, 4),
            r(1, 1, 2, 4),
            r(1, 1, 2, 4),
        ),
    }[op_name]


def test_same_dtype_table_matches_what_eager_kernels_refuse():
    """Every claim of the verifier's same-dtype table is checked against the eager kernel: the
    op runs with one dtype, fails with any listed operand in float16, and the verifier refuses
    that node."""
    from portable.opset import opset_table
    from portable.verify import SAME_DTYPE_OPERANDS
    from portable.verify import _check_dtypes as check_dtypes

    table = opset_table()
    for op_name, operands in SAME_DTYPE_OPERANDS.items():
        entry = table[op_name]
        schema = [a.name for a in entry.overload._schema.arguments]
        assert set(operands) <= set(schema), op_name
        args = _sample(op_name)
        entry.overload(*args)  # one dtype: runs
        check_dtypes(None, entry, args, {})
        for operand in operands:
            mixed = list(args)
            position = schema.index(operand)
            mixed[position] = mixed[position].to(torch.float16)
            with pytest.raises(RuntimeError):
                entry.overload(*mixed)
            with pytest.raises(VerifyError, match=rf"{operand} is torch.float16"):
                check_dtypes(None, entry, mixed, {})


def test_attention_mask_dtype_follows_sdpa():
    from portable.opset import opset_table
    from portable.verify import _check_dtypes as check_dtypes

    entry = opset_table()["portable.attention.default"]
    q = torch.randn(1, 1, 2, 4, dtype=torch.float16)
    for ok in (torch.bool, torch.float32, torch.float16):  # bool, float, or the query's dtype
        mask = torch.zeros(2, 2, dtype=ok)
        entry.overload(q, q, q, mask)
        check_dtypes(None, entry, (q, q, q, mask), {})
    mask = torch.zeros(2, 2, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError):
        entry.overload(q, q, q, mask)
    with pytest.raises(VerifyError, match=r"mask is torch.bfloat16"):
        check_dtypes(None, entry, (q, q), {"v": q, "mask": mask})


# item 12: the loss contract ----------------------------------------------------------------------


def test_a_criterion_is_called_on_the_output_and_the_last_batch_element():
    torch.manual_seed(0)
    model = TwoLayer()
    x, y = torch.randn(6, 4), torch.randint(0, 3, (6,))
    criterion = nn.CrossEntropyLoss(weight=torch.tensor([1.0, 2.0, 0.5]), label_smoothing=0.1)
    step = portable.capture(model, (x, y), loss_fn=criterion, optimizer=portable.optim.SGD(lr=0.1))
    initial = copy.deepcopy(model)
    result = portable.compile(step, backend="cpu")(x, y)
    eager = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = criterion(model(x), y)
    loss.backward()
    eager.step()
    torch.testing.assert_close(result.loss, loss.detach(), rtol=1e-6, atol=0)
    for name, value in model.state_dict().items():
        torch.testing.assert_close(result.state[name], value, rtol=1e-6, atol=1e-7)
    report = check_parity(
        step, (x, y), backends=["cpu"], steps=2, eager_model=initial, loss_fn=criterion
    )
    assert report.ok and any(row.backend == "eager" for row in report.rows), report.format()


def test_a_criterion_needs_inputs_and_a_target():
    with pytest.raises(CaptureError) as info:
        portable.capture(
            TwoLayer(), (torch.randn(2, 4),), loss_fn=nn.MSELoss(), optimizer=portable.optim.SGD()
        )
    assert "MSELoss is called as criterion(model(*inputs), target)" in str(info.value)
    assert "example_batch = (inputs..., target)" in str(info.value)


def test_a_loss_fn_with_the_wrong_arguments_states_the_contract():
    def loss_fn(output, target):
        return F.mse_loss(output, target)

    with pytest.raises(CaptureError) as info:
        portable.capture(
            TwoLayer(),
            (torch.randn(2, 4), torch.randn(2, 3)),
            loss_fn=loss_fn,
            optimizer=portable.optim.SGD(),
        )
    message = str(info.value)
    assert "loss_fn is called as loss_fn(model, *example_batch)" in message
    assert "loss_fn(output, target)" in message and "3 arguments" in message
    assert "lambda model, x, y: loss_fn(model(x), y)" in message


def test_transformer_decoder_failure_names_tgt_is_causal(capsys):
    class Decoder(nn.Module):
        def __init__(self):
            super().__init__()
            layer = nn.TransformerDecoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
            self.decoder = nn.TransformerDecoder(layer, 1)

        def forward(self, tgt, memory):
            mask = nn.Transformer.generate_square_subsequent_mask(tgt.shape[1])
            return self.decoder(tgt, memory, tgt_mask=mask)

    with pytest.raises(CaptureError) as info:
        portable.capture(Decoder(), (torch.randn(2, 5, 16), torch.randn(2, 7, 16)))
    message = str(info.value)
    assert "tgt_is_causal=True" in message and "see the original error" not in message
    assert f"{HERE}:{_line_of('tgt_mask=mask)')}" in message
    assert "def forward(" not in capsys.readouterr().err  # no dump of torch's partial graph


def test_export_failures_without_a_known_remedy_say_what_to_do():
    class Numpy(nn.Module):
        def forward(self, x):
            return torch.from_numpy(x.numpy() * 2)

    class Broadcast(nn.Module):
        def forward(self, x):
            return x + torch.ones(3)  # a shape error of the user's own

    with pytest.raises(CaptureError) as info:
        portable.capture(Numpy(), (torch.randn(4),))
    assert "keep values as torch tensors inside forward" in str(info.value)
    with pytest.raises(CaptureError) as info:
        portable.capture(Broadcast(), (torch.randn(4),))
    message = str(info.value)
    assert "see the original error" not in message
    assert "torch.export cannot trace the line shown" in message
    assert f"{HERE}:{_line_of('a shape error of the user')}" in message


# items 12 and 17: torch.optim optimizers and schedulers ---------------------------------------------


def test_torch_adam_without_weight_decay_is_adamw_exactly():
    torch.manual_seed(0)
    model = TwoLayer()
    x, y = torch.randn(6, 4), torch.randn(6, 3)
    eager = torch.optim.Adam(model.parameters(), lr=1e-2, betas=(0.8, 0.99), eps=1e-7)
    step = portable.capture(
        model, (x, y), loss_fn=lambda m, a, b: F.mse_loss(m(a), b), optimizer=eager
    )
    recorded = step.metadata["optimizer"]
    assert recorded["kind"] == "adamw" and recorded["weight_decay"] == 0.0
    run = portable.compile(step, backend="cpu")
    for _ in range(3):
        result = run(x, y)
        eager.zero_grad()
        F.mse_loss(model(x), y).backward()
        eager.step()
    for name, value in model.state_dict().items():
        torch.testing.assert_close(result.state[name], value, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda p: torch.optim.AdamW(p, maximize=True), "AdamW(maximize=True)"),
        (lambda p: torch.optim.SGD(p, lr=0.1, maximize=True), "SGD(maximize=True)"),
        (lambda p: torch.optim.RMSprop(p), "optimizer RMSprop is not supported"),
    ],
)
def test_torch_optimizers_that_are_not_exact_are_refused(make, message):
    model = TwoLayer()
    with pytest.raises(CaptureError, match=message.replace("(", r"\(").replace(")", r"\)")):
        portable.capture(
            model,
            (torch.randn(2, 4), torch.randn(2, 3)),
            loss_fn=lambda m, a, b: F.mse_loss(m(a), b),
            optimizer=make(model.parameters()),
        )


def _capture_with(model, optimizer, batch=None):
    return portable.capture(
        model,
        batch or (torch.randn(2, 4), torch.randn(2, 3)),
        loss_fn=lambda m, a, b: F.mse_loss(m(a), b),
        optimizer=optimizer,
    )


def test_a_scheduled_optimizer_without_its_schedule_is_refused_by_name():
    model = TwoLayer()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5**step)
    with pytest.raises(CaptureError) as info:
        _capture_with(model, opt)
    message = str(info.value)
    assert "a learning-rate scheduler is attached to AdamW, but none was passed" in message
    assert "schedule=scheduler" in message
    with pytest.raises(CaptureError, match=r"LambdaLR is a learning-rate scheduler"):
        _capture_with(model, scheduler)


def test_an_optimizer_with_state_or_hooks_or_other_parameters_is_refused():
    model = TwoLayer()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    F.mse_loss(model(torch.randn(2, 4)), torch.randn(2, 3)).backward()
    opt.step()
    with pytest.raises(CaptureError, match=r"SGD has state from earlier steps"):
        _capture_with(model, opt)

    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt.register_step_pre_hook(lambda *_: None)
    with pytest.raises(CaptureError, match=r"SGD has step hooks"):
        _capture_with(model, opt)

    opt = torch.optim.SGD(model.fc2.parameters(), lr=0.1)
    with pytest.raises(CaptureError) as info:
        _capture_with(model, opt)
    assert "SGD holds 2 of the model's 4 trainable parameters" in str(info.value)
    assert "fc1.weight" in str(info.value)


def test_frozen_parameters_in_a_torch_optimizer_are_skipped_as_torch_skips_them():
    torch.manual_seed(0)
    model = TwoLayer()
    model.fc1.requires_grad_(False)
    x, y = torch.randn(6, 4), torch.randn(6, 3)
    eager = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    result = portable.compile(_capture_with(model, eager, (x, y)), backend="cpu")(x, y)
    eager.zero_grad()
    F.mse_loss(model(x), y).backward()
    eager.step()
    for name, value in model.state_dict().items():
        torch.testing.assert_close(result.state[name], value, rtol=1e-6, atol=1e-7)

    stray = torch.zeros(3, requires_grad=True)
    with pytest.raises(
        CaptureError, match=r"SGD holds 2 of the model's 2 trainable parameters and 1 other"
    ):
        _capture_with(model, torch.optim.SGD([*model.fc2.parameters(), stray], lr=0.1))


# item 17: torch.autocast ---------------------------------------------------------------------------


class Autocast(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = self.fc(x)  # inside the autocast region
        return y.float()


class AutocastOff(Autocast):
    def forward(self, x):
        with torch.autocast("cpu", enabled=False):  # what Hugging Face's rotary embeddings do
            y = self.fc(x)
        return y


def test_autocast_is_refused_by_name_at_the_users_line():
    for kwargs in ({}, {"loss_fn": lambda m, x: m(x).sum(), "optimizer": portable.optim.SGD()}):
        with pytest.raises(CaptureError) as info:
            portable.capture(Autocast(), (torch.randn(2, 4),), **kwargs)
        message = str(info.value)
        assert "torch.autocast(cpu, dtype=torch.bfloat16) is not captured yet" in message
        assert f"{HERE}:{_line_of('inside the autocast region')}" in message
        assert "eval_with_key" not in message and "fix:" in message


def test_disabled_autocast_still_captures():
    model = AutocastOff()
    x = torch.randn(2, 4)
    program = portable.capture(model, (x,))
    assert torch.equal(portable.compile(program, backend="cpu")(x), model(x))


class NoGradAttention(nn.Module):
    """Composite ops inside a torch.no_grad() region: export puts them in a sub-graph."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)

    def forward(self, x):
        with torch.no_grad():
            context = F.scaled_dot_product_attention(self.proj(x), x, x)  # no gradient to proj
        return self.norm(self.proj(x) + context)


def test_composites_inside_no_grad_regions_become_portable_ops():
    torch.manual_seed(0)
    model, x, y = NoGradAttention(), torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8)
    program = portable.capture(model, (x,))
    ops = {str(n.target) for n in program.graph.nodes if n.op == "call_function"}
    assert "portable.attention.default" in ops and "portable.layer_norm.default" in ops
    assert torch.equal(portable.compile(program, backend="cpu")(x), model.eval()(x))

    def loss_fn(m, a, b):
        return F.mse_loss(m(a), b)

    step = portable.capture(model, (x, y), loss_fn=loss_fn, optimizer=portable.optim.SGD(lr=0.1))
    result = portable.compile(step, backend="cpu")(x, y)
    eager = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = loss_fn(model.train(), x, y)
    loss.backward()
    eager.step()
    torch.testing.assert_close(result.loss, loss.detach(), rtol=1e-6, atol=0)
    for name, value in model.state_dict().items():
        torch.testing.assert_close(result.state[name], value, rtol=1e-5, atol=1e-6)


# item 19: the decorator's entry points -------------------------------------------------------------


def test_the_module_is_the_decorator():
    @portable(example_inputs=lambda: (torch.randn(2, 4),))
    class Called(TwoLayer):
        pass

    @portable
    class Bare(TwoLayer):
        pass

    from portable import portable as decorator

    @decorator(example_inputs=(torch.randn(2, 4),))
    def factory():
        return TwoLayer()

    assert portable.spec_of(Called).example_inputs is not None
    assert portable.spec_of(Bare).name == "test_the_module_is_the_decorator.<locals>.Bare"
    assert portable.spec_of(factory).name.endswith("factory")
    assert portable.capture_spec(Called).name.endswith("Called")


def test_capture_spec_takes_the_decorated_object_or_its_spec():
    spec = portable.ModelSpec(target=TwoLayer, name="TwoLayer", example_inputs=(torch.randn(2, 4),))
    program = portable.capture_spec(spec)
    assert program.name == "TwoLayer"
    with pytest.raises(CaptureError) as info:
        portable.capture_spec(TwoLayer)
    assert "TwoLayer is not decorated with @portable" in str(info.value)
    assert "fix: decorate it with @portable(example_inputs=...)" in str(info.value)


def test_a_data_dependent_shape_is_refused_as_such_with_a_static_fix():
    class Positive(nn.Module):
        def forward(self, x):
            return x[x > 0] * 2  # boolean-mask indexing: as many elements as are positive

    with pytest.raises(portable.PortableError, match="depends on the input's values") as info:
        portable.capture(Positive(), (torch.randn(8),))
    assert "torch.where" in info.value.fix and "dynamic_shapes" not in info.value.fix
