"""Randomness as part of the program (portable/random.py, portable/capture/dropout.py).

- the generator: Threefry-2x32 equals Random123's known answers and JAX's threefry bit for bit
  (`jax.random.bits` for stream 0), uniforms are exact multiples of 2^-n in [0, 1);
- statistics: the kept fraction of 1e5 elements within a binomial bound, masks of different
  streams / offsets / seeds agree as often as independent ones would;
- dropout's arithmetic is torch's (`native_dropout`, `alpha_dropout`), with its edge cases;
- captured programs draw the same masks on cpu, xla, onnx and cuda (Triton's interpreter), as
  the eager module does; neuron lowers them with no validation error;
- under a DP=2 or TP=2 plan every rank computes its slice of the global mask (outputs equal
  the single-device run's bit for bit; training losses equal to rounding);
- `CounterDropout` around an exported forward replaces F.dropout, nn.Dropout, channel and alpha
  dropout and SDPA's dropout, and the captured training step equals the eager run under the
  same mode.
"""

from __future__ import annotations

import copy
import math
import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import portable
from portable import Mesh, Plan
from portable import parallel as par
from portable import random as R
from portable.backends.neuron.findings import Severity
from portable.backends.xla.spmd import run_spmd
from portable.capture.dropout import CounterDropout, attention_math
from portable.ir.plan import ShardingRule
from portable.passes.spmd_partition import partition

jax = pytest.importorskip("jax")
jnp = jax.numpy
from jax._src.random.threefry2x32 import threefry2x32_p, threefry_2x32  # noqa: E402

M32 = 0xFFFFFFFF


def _words_of(a: np.ndarray) -> torch.Tensor:
    """uint32 values as the int32 tensor of their bits."""
    return torch.from_numpy(a.view(np.int32).copy())


def _word(value: int) -> torch.Tensor:
    return _words_of(np.array(value & M32, dtype=np.uint32))


def _u32(t: torch.Tensor) -> np.ndarray:
    return (t.to(torch.int64) & M32).numpy().astype(np.uint32)


def _i64(v: int) -> torch.Tensor:
    return torch.tensor(v, dtype=torch.int64)


def _words(value: int) -> np.ndarray:
    return np.array([(value >> 32) & M32, value & M32], np.uint32)


def _jax_key(seed: int, offset: int) -> np.ndarray:
    """The key as JAX computes it: threefry_2x32(PRNGKey(seed), [offset hi, offset lo])."""
    return np.asarray(threefry_2x32(_words(seed), _words(offset)))


# -- the generator ------------------------------------------------------------------------------

# Random123's kat_vectors for threefry2x32_20 (also JAX's test vectors): key, counter, result
KAT = [
    ((0, 0), (0, 0), (0x6B200159, 0x99BA4EFE)),
    ((M32, M32), (M32, M32), (0x1CB996FC, 0xBB002BE7)),
    ((0x13198A2E, 0x03707344), (0x243F6A88, 0x85A308D3), (0xC4923A9C, 0x483DF7A0)),
]


@pytest.mark.parametrize(("key", "counter", "want"), KAT)
def test_threefry_known_answers(key, counter, want):
    y = R.threefry2x32(tuple(map(_word, key)), tuple(map(_word, counter)))
    assert [int(_u32(v)) for v in y] == list(want)


def test_threefry_equals_jax_on_random_words():
    rng = np.random.default_rng(0)
    k = rng.integers(0, 1 << 32, 2, dtype=np.uint64).astype(np.uint32)
    c0, c1 = (rng.integers(0, 1 << 32, 4096, dtype=np.uint64).astype(np.uint32) for _ in "ab")
    y0, y1 = R.threefry2x32((_word(int(k[0])), _word(int(k[1]))), (_words_of(c0), _words_of(c1)))
    j0, j1 = threefry2x32_p.bind(jnp.uint32(k[0]), jnp.uint32(k[1]), c0, c1)
    assert np.array_equal(_u32(y0), np.asarray(j0)) and np.array_equal(_u32(y1), np.asarray(j1))


def test_seed_words_are_jax_prng_key_data():
    seed = 0x123456789ABCDEF
    with jax.enable_x64(True):
        data = jax.random.key_data(jax.random.PRNGKey(np.int64(seed)))
    assert np.array_equal(np.asarray(data), _words(seed))


@pytest.mark.parametrize(
    ("seed", "offset"), [(0, 0), (1234, 7), (0x123456789ABCDEF, 1 << 40), (-5, (1 << 63) - 1)]
)
def test_key_and_bits_equal_jax(seed, offset):
    key = R.key(_i64(seed), _i64(offset))
    jkey = _jax_key(seed, offset)
    assert [int(_u32(key.k0)), int(_u32(key.k1))] == [int(w) for w in jkey]
    # stream 0: jax.random.bits over the shape (threefry, partitionable counters)
    want = jax.random.bits(jax.random.wrap_key_data(jkey), (3, 5, 7), jnp.uint32)
    assert np.array_equal(_u32(R.bits(key, 0, (3, 5, 7))), np.asarray(want))
    # stream s: the counter's high word
    j0, j1 = threefry2x32_p.bind(
        jnp.uint32(jkey[0]),
        jnp.uint32(jkey[1]),
        jnp.full(11, 5, jnp.uint32),
        jnp.arange(11, dtype=jnp.uint32),
    )
    assert np.array_equal(_u32(R.bits(key, 5, (11,))), np.asarray(j0 ^ j1))


@pytest.mark.parametrize(
    ("dtype", "n"),
    [(torch.float32, 24), (torch.bfloat16, 8), (torch.float16, 11), (torch.float64, 31)],
)
def test_uniform_is_the_top_bits_exactly(dtype, n):
    seed, offset = _i64(3), _i64(4)
    u = R.uniform(seed, offset, 2, (4096,), dtype)
    assert u.dtype == dtype and 0 <= u.min() and u.max() < 1
    top = _u32(R.bits(R.key(seed, offset), 2, (4096,))).astype(np.int64) >> (32 - n)
    assert np.array_equal(u.double().numpy(), top * 2.0**-n)


def test_keep_is_uniform_at_least_p_exactly():
    key = R.key(_i64(11), _i64(0))
    u = R.uniform(_i64(11), _i64(0), 0, (1 << 14,))
    for p in (0.1, 0.15, 0.5, 1 - 2**-24):
        assert torch.equal(R.keep_mask(key, 0, (1 << 14,), p), u.double() >= p)


def test_counter_is_limited_to_one_word():
    key = R.key(_i64(0), _i64(0))
    with pytest.raises(portable.InputError, match="at most 4294967296 elements"):
        R.bits(key, 0, (1 << 16, 1 << 16, 2))
    with pytest.raises(portable.InputError, match="int64 0-d tensor"):
        R.key(torch.tensor([1]), _i64(0))


# -- statistics ---------------------------------------------------------------------------------

N = 100_000


def _within(count: int, n: int, q: float, sigmas: float = 5.0) -> bool:
    return abs(count - n * q) <= sigmas * math.sqrt(n * q * (1 - q))


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_kept_fraction_is_binomial(p):
    keep = R.keep_mask(R.key(_i64(2024), _i64(1)), 0, (N,), p)
    assert _within(int(keep.sum()), N, 1 - p)


def test_streams_offsets_and_seeds_are_decorrelated():
    p = 0.5
    base = R.keep_mask(R.key(_i64(1), _i64(0)), 0, (N,), p)
    others = {
        "stream": R.keep_mask(R.key(_i64(1), _i64(0)), 1, (N,), p),
        "offset": R.keep_mask(R.key(_i64(1), _i64(1)), 0, (N,), p),
        "seed": R.keep_mask(R.key(_i64(2), _i64(0)), 0, (N,), p),
    }
    for name, other in others.items():
        assert _within(int((base == other).sum()), N, 0.5), name  # independent: half agree
    u = R.uniform(_i64(1), _i64(0), 0, (N,)).double()
    v = R.uniform(_i64(1), _i64(0), 1, (N,)).double()
    assert abs(u.mean() - 0.5) < 5 * math.sqrt(1 / 12 / N)
    assert abs(torch.corrcoef(torch.stack([u, v]))[0, 1]) < 5 / math.sqrt(N)
    assert abs(torch.corrcoef(torch.stack([u[:-1], u[1:]]))[0, 1]) < 5 / math.sqrt(N)


# -- dropout's arithmetic -----------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("p", [0.1, 0.15, 0.5])
def test_dropout_scales_as_torch_native_dropout(p, dtype):
    x = torch.randn(64, 33, dtype=dtype)
    # torch's own kernel: its output is x * (mask * (1 / (1 - p))) with its mask, the noise
    # rounded to x's dtype first
    out, mask = torch.native_dropout(x, p, True)
    assert torch.equal(out, x * (mask.to(dtype) * (1 / (1 - p))))
    # ours computes that formula with the counter-based mask
    key = R.key(_i64(9), _i64(2))
    keep = R.keep_mask(key, 3, x.shape, p)
    got = R.apply_dropout(x, p, key, 3)
    assert torch.equal(got, x * (keep.to(dtype) * (1 / (1 - p))))
    assert torch.equal(R.dropout(x, p, _i64(9), _i64(2), 3), got)


ALPHA = 1.7580993408473766  # torch's alpha dropout constant (SELU's scale * alpha)


def _alpha(x: torch.Tensor, noise: torch.Tensor, p: float) -> torch.Tensor:
    """ATen's alpha dropout given its noise: x * (noise * a) + ((noise - 1) * alpha a + alpha a p)."""
    a = 1 / math.sqrt((ALPHA**2 * p + 1) * (1 - p))
    return x * (noise * a) + ((noise - 1) * (ALPHA * a) + ALPHA * a * p)


def test_alpha_dropout_is_torch_affine():
    p = 0.2
    x = torch.randn(4096)
    out = torch.alpha_dropout(x, p, True)
    dropped = _alpha(torch.zeros(()), torch.zeros(()), p)  # what a dropped unit becomes
    assert torch.equal(out, _alpha(x, ((out - dropped).abs() > 1e-6).float(), p))
    key = R.key(_i64(1), _i64(1))  # ours is that formula with its own mask
    noise = R.keep_mask(key, 0, x.shape, p).float()
    assert torch.equal(R.apply_dropout(x, p, key, 0, alpha=True), _alpha(x, noise, p))


def test_dropout_edge_cases_are_torch_s():
    x = torch.tensor([1.0, -2.0, float("nan"), float("inf")])
    seed, offset = _i64(0), _i64(0)
    assert R.dropout(x, 0.0, seed, offset, 0) is x
    assert R.dropout(x, 0.5, seed, offset, 0, training=False) is x
    empty = torch.empty(0, 3)
    assert R.dropout(empty, 0.5, seed, offset, 0) is empty
    ones = R.dropout(x, 1.0, seed, offset, 0)  # torch: input * 0 (NaN and inf stay NaN)
    torch.testing.assert_close(ones, F.dropout(x, 1.0), equal_nan=True, rtol=0, atol=0)
    assert torch.equal(torch.signbit(ones[:2]), torch.tensor([False, True]))
    with pytest.raises(portable.InputError, match="between 0 and 1, but got 1.5"):
        R.dropout(x, 1.5, seed, offset, 0)
    with pytest.raises(portable.InputError, match="floating-point"):
        R.dropout(torch.ones(3, dtype=torch.int64), 0.5, seed, offset, 0)


# -- captured programs --------------------------------------------------------------------------


class Masked(torch.nn.Module):
    """y = dropout(x * scale): elementwise only, so every backend's output is the mask's bits;
    `scale` is split over tp by a plan (tensor parallel), x's batch over dp."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.linspace(0.5, 2.0, 16))
        self.register_buffer("seed", _i64(1234))
        self.register_buffer("offset", _i64(5))

    def forward(self, x):
        return R.dropout(x * self.scale, 0.25, self.seed, self.offset, 0)


class TrainMLP(torch.nn.Module):
    """Dropout after a column- and a row-parallel linear; the offset advances every step."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(16, 32)
        self.proj = torch.nn.Linear(32, 16)
        self.register_buffer("seed", _i64(99))
        self.register_buffer("offset", _i64(0))

    def forward(self, x):
        out = R.dropout(self.proj(torch.relu(self.fc(x))), 0.1, self.seed, self.offset, 0)
        self.offset.add_(1)
        return out


def _mse(model, x, y):
    return F.mse_loss(model(x), y)


X = torch.randn(4, 6, 16, generator=torch.Generator().manual_seed(0))
Y = torch.randn(4, 6, 16, generator=torch.Generator().manual_seed(1))
TP_RULES = {  # tensor parallel: Masked's scale split; TrainMLP's column- and row-parallel pair
    "masked": [ShardingRule("scale", portable.PartitionSpec("tp"))],
    "training": par.column_parallel("fc") + par.row_parallel("proj"),
}


def _plan(name: str, model: str) -> Plan:
    if name == "dp":
        return Plan(Mesh({"dp": 2}), batch_axes=("dp",))
    return Plan(Mesh({"tp": 2}), rules=TP_RULES[model])


@pytest.fixture(scope="module")
def masked():
    torch.manual_seed(0)
    model = Masked()
    return model, portable.capture(model, (X,))


@pytest.fixture(scope="module")
def training():
    torch.manual_seed(0)
    model = TrainMLP()
    eager = copy.deepcopy(model)
    program = portable.capture(model, (X, Y), loss_fn=_mse, optimizer=portable.optim.SGD(lr=0.1))
    return eager, program


@pytest.mark.parametrize("backend", ["cpu", "xla", "onnx"])
def test_captured_masks_are_bit_identical_across_backends(masked, backend):
    model, program = masked
    got = portable.compile(program, backend)(X)
    assert torch.equal(got, model(X))  # the eager module's masks, bit for bit
    assert 0.2 < (got == 0).float().mean() < 0.3  # a quarter dropped


def test_masks_survive_the_archive(masked, tmp_path):
    model, program = masked
    loaded = portable.load(program.save(tmp_path / "masked.portable"))
    assert loaded.weights["seed"] == 1234 and loaded.weights["offset"] == 5
    assert torch.equal(portable.compile(loaded, "cpu")(X), model(X))


def test_training_step_equals_eager_torch_and_advances_the_offset(training):
    eager, program = training
    cpu, xla = portable.compile(program, "cpu"), portable.compile(program, "xla")
    opt = torch.optim.SGD(eager.parameters(), lr=0.1)
    for step in range(3):
        opt.zero_grad()
        loss = _mse(eager, X, Y)
        loss.backward()
        opt.step()
        assert torch.equal(cpu(X, Y).loss, loss.detach())  # same masks, same arithmetic
        torch.testing.assert_close(xla(X, Y).loss, loss.detach(), rtol=1e-6, atol=1e-7)
        assert int(cpu.state["offset"]) == int(xla.state["offset"]) == step + 1
    for name, value in eager.state_dict().items():
        assert torch.equal(cpu.state[name], value), name


def test_neuron_lowers_dropout_with_no_validation_error(training, masked):
    for program in (training[1], masked[1]):
        (record,) = portable.lower(program, "neuron:trn3").payload.programs
        errors = [f for f in record.findings if f.severity is Severity.ERROR]
        assert errors == []
        # int64 only on the 0-d seed and offset (Neuron computes int64 as int32)
        assert {f.code for f in record.findings} <= {"int64-downcast", "fp64-downcast"}


def test_cuda_kernel_graph_draws_the_cpu_masks(masked, training):
    pytest.importorskip("triton")
    from portable.backends import Target
    from portable.backends.cuda import CudaBackend, CudaOptions

    backend = CudaBackend(CudaOptions(device="cpu", torch_compile=False))

    def interpreted(program):
        return backend.executable(backend.write(backend.lower(program, Target("cuda", "sm_90"))))

    model, program = masked
    assert torch.equal(interpreted(program)(X), model(X))
    exe, cpu = interpreted(training[1]), portable.compile(training[1], "cpu")
    for _ in range(2):
        torch.testing.assert_close(exe(X, Y).loss, cpu(X, Y).loss, rtol=1e-6, atol=1e-7)


# -- under a plan: every rank draws its slice of the global mask -------------------------------


@pytest.mark.parametrize("plan", ["dp", "tp"])
def test_partitioned_masks_are_slices_of_the_global_mask(masked, plan):
    model, program = masked
    per_rank, _ = partition(program.replace(plan=_plan(plan, "masked")))
    portable.verify(per_rank)
    # what is sliced is the counters' aranges (global indices) and inputs, never a mask
    sliced = {
        n.args[0].target if n.args[0].op == "call_function" else n.args[0].op
        for n in per_rank.graph.nodes
        if n.target is torch.ops.portable.local_shard.default
    }
    assert sliced == {torch.ops.aten.arange.start_step} | (
        {"placeholder"} if plan == "tp" else set()
    )
    hashed = [n for n in per_rank.graph.nodes if n.target is torch.ops.aten.bitwise_xor.Tensor]
    assert all(n.meta["tensor"].shape in ((2, 6, 16), (4, 6, 8), ()) for n in hashed)
    flat = [program.weights[i.target] for i in program.signature.state_inputs] + [X]
    (got,) = run_spmd(per_rank, flat).outputs
    assert torch.equal(got, model(X))


@pytest.mark.parametrize("plan", ["dp", "tp"])
def test_partitioned_training_loss_equals_single_device(training, plan):
    eager, program = training
    per_rank, _ = partition(program.replace(plan=_plan(plan, "training")))
    flat = [program.weights[i.target] for i in program.signature.state_inputs] + [X, Y]
    result = run_spmd(per_rank, flat, steps=2)
    cpu = portable.compile(program, "cpu")
    for loss in result.losses:
        torch.testing.assert_close(loss, cpu(X, Y).loss, rtol=1e-6, atol=1e-7)
    assert int(result.state["offset"]) == 2


# -- CounterDropout: torch's dropout spellings, replaced -------------------------------------


def _mode():
    return CounterDropout(_i64(5), _i64(3))


def test_mode_replaces_every_dropout_spelling_in_call_order():
    x4 = torch.randn(2, 3, 4, 5)
    x3 = torch.randn(3, 4, 5)
    with _mode() as mode:
        got = [
            torch.nn.Dropout(0.3)(x4),
            F.dropout(x4, 0.2),
            torch.dropout(x4, 0.4, True),
            F.dropout1d(x3, 0.5),  # (N, C, L)
            F.dropout1d(x3[0], 0.5),  # unbatched (C, L): a batch of one around the draw
            torch.nn.Dropout2d(0.5)(x4),
            F.dropout3d(x4, 0.5),  # unbatched (C, D, H, W)
            F.alpha_dropout(x4, 0.3, training=True),
            F.feature_alpha_dropout(x4, 0.3, training=True),
        ]
    key = R.key(_i64(5), _i64(3))
    want = [
        R.apply_dropout(x4, 0.3, key, 0),
        R.apply_dropout(x4, 0.2, key, 1),
        R.apply_dropout(x4, 0.4, key, 2),
        R.apply_dropout(x3, 0.5, key, 3, feature=True),
        R.apply_dropout(x3[0][None], 0.5, key, 4, feature=True)[0],
        R.apply_dropout(x4, 0.5, key, 5, feature=True),
        R.apply_dropout(x4[None], 0.5, key, 6, feature=True)[0],
        R.apply_dropout(x4, 0.3, key, 7, alpha=True),
        R.apply_dropout(x4, 0.3, key, 8, feature=True, alpha=True),
    ]
    assert mode.streams == len(want)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(g, w), i
    channel = got[5].flatten(2)  # whole channels kept or zeroed
    assert ((channel == 0).all(-1) | (channel != 0).all(-1)).all()


def test_mode_passes_through_calls_that_draw_nothing_and_keeps_in_place_writes():
    x = torch.randn(4, 5)
    attention = F.scaled_dot_product_attention(x[None], x[None], x[None])
    with _mode() as mode:
        assert F.dropout(x, 0.5, training=False) is x
        assert torch.equal(F.dropout(x, 0.0), x)
        assert torch.equal(torch.nn.Dropout(0.5).eval()(x), x)
        assert torch.equal(F.alpha_dropout(x, 0.5), x)  # F.alpha_dropout's training=False
        assert torch.equal(F.scaled_dot_product_attention(x[None], x[None], x[None]), attention)
        with pytest.raises(ValueError, match="between 0 and 1"):
            F.dropout(x, 1.5)  # torch's own check
        assert mode.streams == 0
        y = x.clone()
        out = F.dropout(y, 0.5, inplace=True)
    assert out is y and torch.equal(y, R.apply_dropout(x, 0.5, R.key(_i64(5), _i64(3)), 0))


def test_sdpa_dropout_is_torch_math_attention_with_the_keep_mask():
    q, k, v = torch.randn(2, 4, 5, 8), torch.randn(2, 2, 6, 8), torch.randn(2, 2, 6, 8)
    with _mode() as mode:
        got = F.scaled_dot_product_attention(
            q, k, v, dropout_p=0.3, is_causal=True, enable_gqa=True
        )
    assert mode.streams == 1
    keep = R.keep_mask(R.key(_i64(5), _i64(3)), 0, (2, 4, 5, 6), 0.3)
    assert torch.equal(got, attention_math(q, k, v, None, 0.3, keep, True, None, True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("mask", "causal", "scale", "gqa"),
    [
        ("bool", False, None, False),
        ("float", False, 0.3, True),
        (None, True, -0.2, False),
        ("row", False, None, True),
    ],
)
def test_attention_math_is_torch_s_op_for_op(dtype, mask, causal, scale, gqa):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 5, 8, generator=g).to(dtype)
    k, v = (torch.randn(2, 2 if gqa else 4, 6, 8, generator=g).to(dtype) for _ in "kv")
    keep = torch.rand(2, 4, 5, 6, generator=g) > 0.3
    m = {
        None: None,
        "bool": torch.rand(5, 6, generator=g) > 0.3,
        "float": torch.randn(2, 1, 5, 6, generator=g).to(dtype),
        "row": torch.ones(5, 6, dtype=torch.bool).index_fill(0, torch.tensor([1]), False),
    }[mask]
    # the private op takes the additive mask SDPA converts bool masks into
    additive = (
        torch.where(m, 0.0, -math.inf).to(dtype) if m is not None and m.dtype == torch.bool else m
    )
    want = torch.ops.aten._scaled_dot_product_attention_math(
        q, k, v, additive, 0.3, causal, dropout_mask=keep, scale=scale, enable_gqa=gqa
    )[0]
    assert torch.equal(attention_math(q, k, v, m, 0.3, keep, causal, scale, gqa), want)


def test_multihead_attention_dropout_is_refused_with_the_fix():
    mha = torch.nn.MultiheadAttention(8, 2, dropout=0.1, batch_first=True)
    x = torch.randn(2, 3, 8)
    with _mode(), pytest.raises(portable.CaptureError, match="dropout=0.0") as info:
        mha(x, x, x)
    assert "F.multi_head_attention_forward" in str(info.value)
    with _mode() as mode:
        mha.eval()(x, x, x)  # no draw in eval
    assert mode.streams == 0


class Block(torch.nn.Module):
    """A transformer-ish block: nn.Dropout (F.dropout) and SDPA's attention dropout."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = torch.nn.Linear(16, 48)
        self.out = torch.nn.Linear(16, 16)
        self.drop = torch.nn.Dropout(0.1)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(self.drop(x)).view(b, s, 3, 2, 8).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, dropout_p=0.2, is_causal=True)
        return self.out(a.transpose(1, 2).reshape(b, s, 16))


class Hooked(torch.nn.Module):
    """What training capture's hook does: the forward under CounterDropout over rng state."""

    def __init__(self) -> None:
        super().__init__()
        self.block = Block()
        self.register_buffer("rng_seed", _i64(42))
        self.register_buffer("rng_offset", _i64(0))
        self.streams = 0

    def forward(self, x):
        with CounterDropout(self.rng_seed, self.rng_offset) as mode:
            out = self.block(x)
        self.streams = mode.streams
        if mode.streams:
            self.rng_offset.add_(1)
        return out


def test_exported_training_step_under_the_mode_equals_eager():
    torch.manual_seed(0)
    model = Hooked()
    eager = copy.deepcopy(model)
    x, y = torch.randn(2, 8, 16), torch.randn(2, 8, 16)
    program = portable.capture(model, (x, y), loss_fn=_mse, optimizer=portable.optim.SGD(lr=0.1))
    random_ops = {"native_dropout", "bernoulli", "rand", "rand_like", "scaled_dot_product"}
    assert not any(any(r in str(n.target) for r in random_ops) for n in program.graph.nodes)
    cpu = portable.compile(program, "cpu")
    opt = torch.optim.SGD(eager.parameters(), lr=0.1)
    for step in range(2):
        opt.zero_grad()
        loss = _mse(eager, x, y)
        loss.backward()
        opt.step()
        assert eager.streams == 2  # nn.Dropout and SDPA drew
        assert torch.equal(cpu(x, y).loss, loss.detach())  # the same masks and arithmetic
        assert int(cpu.state["rng_offset"]) == step + 1
    for name, value in eager.state_dict().items():
        assert torch.equal(cpu.state[name], value), name


def test_sdpa_dropout_the_mode_does_not_see_is_still_refused():
    class Attention(torch.nn.Module):
        def forward(self, x):  # dropout even in eval: inference capture runs no mode
            return F.scaled_dot_product_attention(x, x, x, dropout_p=0.1)

    with pytest.raises(
        portable.CaptureError, match="reached the graph as torch's random draw"
    ) as e:
        portable.capture(Attention(), (torch.randn(1, 2, 4, 8),))
    assert "counter-based generator" in e.value.fix


FULL = os.environ.get("PORTABLE_SLOW") == "full"


class HfStep(torch.nn.Module):
    """A Hugging Face language model's loss under CounterDropout (the training hook's shape)."""

    def __init__(self, model) -> None:
        super().__init__()
        self.model = model
        self.register_buffer("rng_seed", _i64(42))
        self.register_buffer("rng_offset", _i64(0))

    def forward(self, ids):
        with CounterDropout(self.rng_seed, self.rng_offset) as mode:
            loss = self.model(input_ids=ids, labels=ids).loss
        if mode.streams:
            self.rng_offset.add_(1)
        return loss


@pytest.mark.hf
@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt2", "bert"])
def test_stock_hf_configs_train_with_dropout_as_eager(hf_model, name):
    """GPT-2 and BERT with their stock dropout (0.1: embeddings, attention, residuals): the
    captured step equals eager training under the same mode, bit for bit (about 20 s each)."""
    if not FULL:
        pytest.skip("PORTABLE_SLOW=full runs it; the Hooked block test is its small form")
    stock = {"gpt2": dict(attn_pdrop=0.1, resid_pdrop=0.1, embd_pdrop=0.1)}.get(name, {})
    extra = (
        {} if name == "gpt2" else dict(attention_probs_dropout_prob=0.1, hidden_dropout_prob=0.1)
    )
    torch.manual_seed(0)
    step = HfStep(hf_model(name, **stock, **extra))
    eager = copy.deepcopy(step)
    ids = torch.randint(1, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    program = portable.capture(
        step, (ids,), loss_fn=lambda m, i: m(i), optimizer=portable.optim.SGD(lr=0.1)
    )
    cpu = portable.compile(program, "cpu")
    opt = torch.optim.SGD(eager.parameters(), lr=0.1)
    for _ in range(2):
        opt.zero_grad()
        loss = eager(ids)
        loss.backward()
        opt.step()
        assert torch.equal(cpu(ids).loss, loss.detach())
    assert int(cpu.state["rng_offset"]) == 2
