"""Real-model constructs that capture had to learn, or refuses with the remedy (issue 13).

- Hugging Face MoE (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek-V3): the default experts
  implementations (`grouped_mm`: `aten.sort` + routing-dependent group sizes; `eager`: a loop
  over `nonzero`) are refused naming `experts_implementation='batched_mm'`, which captures and
  equals eager bit for bit.
- DeepSeek-V3's attention writes into slices with `copy_` (`aten.copy`): decomposed at capture.
- torchtitan's Llama 3 rotary embeddings (`view_as_complex` * a complex64 `freqs_cis` buffer):
  rewritten into real pairs at capture (portable/capture/complex_pairs.py).
- flex attention: refused, naming scaled_dot_product_attention with the mask to use instead.

HF models are built from small configs (no downloads). CI runs one family per construct;
PORTABLE_SLOW=full runs every family, implementation and backend parity.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import portable
from portable.testing import check_parity

FULL = os.environ.get("PORTABLE_SLOW") == "full"
VOCAB = 128
INFERENCE_TOL = {"rtol": 1e-5, "atol": 1e-6}
SGD_TOL = {"rtol": 1e-4, "atol": 1e-6}


def _op_names(program) -> set[str]:
    return {
        portable.opset.op_name(n.target) for n in program.graph.nodes if n.op == "call_function"
    }


def _lm_loss(model, ids, targets):
    out = model(ids)
    logits = out.logits if hasattr(out, "logits") else out
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


# --------------------------------------------------------------------------- Hugging Face MoE

_SMALL = dict(
    vocab_size=VOCAB,
    bos_token_id=0,
    eos_token_id=0,
    pad_token_id=0,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    use_cache=False,
)
MOE = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4)),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        dict(num_experts=4, moe_intermediate_size=32, shared_expert_intermediate_size=64),
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(num_experts=4, moe_intermediate_size=32),
    ),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", dict(num_experts=4)),
    "deepseek_v3": (
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        dict(
            n_routed_experts=4,
            n_shared_experts=1,
            moe_intermediate_size=32,
            first_k_dense_replace=0,  # the one layer is an MoE layer
            n_group=1,
            topk_group=1,
            q_lora_rank=32,
            kv_lora_rank=16,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=16,
            num_key_value_heads=4,
        ),
    ),
}


def _hf_moe(name: str, **overrides):
    transformers = pytest.importorskip("transformers")
    config, model, extra = MOE[name]
    cfg = getattr(transformers, config)(
        **{**_SMALL, "num_experts_per_tok": 2, **extra, **overrides}
    )
    torch.manual_seed(0)
    return getattr(transformers, model)(cfg)


def _ids(seed: int = 0, shape=(2, 8)) -> torch.Tensor:
    return torch.randint(0, VOCAB, shape, generator=torch.Generator().manual_seed(seed))


REFUSED = [(n, "grouped_mm") for n in MOE if n != "deepseek_v3"] + [("mixtral", "eager")]
REFUSED = REFUSED if FULL else [("qwen3_moe", "grouped_mm"), ("mixtral", "eager")]
WHY = {"grouped_mm": "aten.sort", "eager": "nonzero"}


@pytest.mark.hf
@pytest.mark.slow
@pytest.mark.parametrize(("name", "impl"), REFUSED)
def test_hf_moe_default_experts_are_refused_and_the_named_fix_captures(name, impl):
    model = _hf_moe(name, experts_implementation=impl if impl != "grouped_mm" else None).eval()
    assert model.config._experts_implementation == impl  # grouped_mm is transformers' default
    ids = _ids()
    with pytest.raises(portable.CaptureError) as info:
        portable.capture(model, (ids,))
    message = str(info.value)
    assert f"experts_implementation={impl!r}" in message and WHY[impl] in message
    assert "module `model.layers.0.mlp.experts`" in message
    assert (
        "fix: switch the model" in message and "set_experts_implementation('batched_mm')" in message
    )
    model.set_experts_implementation("batched_mm")  # the fix the message names
    program = portable.capture(model, (ids,))
    with torch.no_grad():
        assert torch.equal(portable.compile(program)(ids), model(ids).logits)


def test_hf_experts_remedy_only_restates_failures_inside_the_experts():
    import inspect

    from portable.capture.known_constructs import explain

    model = _hf_moe("mixtral")  # grouped_mm
    experts = model.model.layers[0].mlp.experts
    attention = model.model.layers[0].self_attn
    file = inspect.getsourcefile(type(experts))
    line = inspect.getsourcelines(type(experts))[1] + 1

    def error(module=None, source=None):
        return portable.CaptureError(
            "op aten.x.default is not in the portable opset", module=module, source=source
        )

    from transformers.integrations import moe

    inside = [
        error(module="model.layers.0.mlp.experts"),
        error(source=f"{file}:{line}  `code`"),
        error(source=f"{moe.__file__}:634"),
    ]
    for e in inside:
        assert "experts_implementation='grouped_mm'" in str(explain(e, model)), e
    attention_line = inspect.getsourcelines(type(attention))[1] + 1
    outside = [
        error(module="model.layers.0.self_attn"),
        error(source=f"{file}:{attention_line}"),
        error(),
    ]
    for e in outside:
        assert explain(e, model) is e
    model.set_experts_implementation("batched_mm")
    assert explain(inside[0], model) is inside[0]


CAPTURED = list(MOE) if FULL else ["qwen2_moe", "deepseek_v3"]


@pytest.mark.hf
@pytest.mark.slow
@pytest.mark.parametrize("name", CAPTURED)
def test_hf_moe_batched_experts_match_eager_and_xla(name):
    model = _hf_moe(name, experts_implementation="batched_mm").eval()
    ids = _ids()
    program = portable.capture(model, (ids,))
    assert "aten.copy.default" not in _op_names(program)
    with torch.no_grad():
        assert torch.equal(portable.compile(program)(ids), model(ids).logits)
    report = check_parity(program, (ids,), backends=["xla"], **INFERENCE_TOL)
    assert report.ok, report.format()


TRAINED = list(MOE) if FULL else ["deepseek_v3"]


@pytest.mark.hf
@pytest.mark.slow
@pytest.mark.parametrize("name", TRAINED)
def test_hf_moe_training_step_matches_eager_and_xla(name):
    model = _hf_moe(name, experts_implementation="batched_mm")
    batch = (_ids(0), _ids(1))
    opt = portable.optim.SGD(lr=1e-2)
    program = portable.capture(model, batch, loss_fn=_lm_loss, optimizer=opt)
    report = check_parity(
        program, batch, backends=["xla"], steps=2, eager_model=model, loss_fn=_lm_loss, **SGD_TOL
    )
    assert report.ok, report.format()
    assert {r.backend for r in report.rows} == {"eager", "xla"}


# --------------------------------------------------------------------------- aten.copy


class _WritesSlices(nn.Module):
    """DeepSeek-V3's key construction: an empty tensor whose slices are written with copy_,
    one from a broadcast and one from another dtype."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 6)
        self.rot = nn.Parameter(torch.randn(1, 1, 3, dtype=torch.float64))

    def forward(self, x):
        nope = self.proj(x)
        out = nope.new_empty(*nope.shape[:-1], 9)
        out[..., :6].copy_(nope)
        out[..., 6:].copy_(self.rot.expand(nope.shape[0], -1, -1))  # broadcast, float64 -> 32
        return out * 2


def test_copy_into_slices_is_decomposed_and_bit_identical():
    torch.manual_seed(0)
    model = _WritesSlices().eval()
    x = torch.randn(2, 5, 8)
    program = portable.capture(model, (x,))
    assert "aten.copy.default" not in _op_names(program)
    with torch.no_grad():
        assert torch.equal(portable.compile(program)(x), model(x))


# --------------------------------------------------------------------------- torchtitan Llama 3
# A model of torchtitan's llama3 (torchtitan/models/llama3/model/model.py): the same rotary
# arithmetic (precompute_freqs_cis with the Llama 3.1 frequency scaling and torch.polar into a
# complex64 buffer; apply_rotary_emb through view_as_complex / view_as_real; the three ways
# reshape_for_broadcast selects rows by positions), GQA with repeat_kv, SwiGLU, RMSNorm.


def _llama3_scaled(
    freqs: torch.Tensor, factor=8.0, low=1.0, high=4.0, original=8192
) -> torch.Tensor:
    wavelen = 2 * torch.pi / freqs
    low_wavelen, high_wavelen = original / low, original / high
    scaled = torch.where(wavelen > low_wavelen, freqs / factor, freqs)
    smooth = (original / wavelen - low) / (high - low)
    mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(mid, (1 - smooth) * scaled / factor + smooth * scaled, scaled)


def precompute_freqs_cis(head_dim: int, end: int, theta: float = 500000.0) -> torch.Tensor:
    """cis(t * f) for t < end and the head_dim / 2 rotary frequencies f: complex64 [end, hd/2]."""
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2)[: head_dim // 2].float() / head_dim))
    angles = torch.outer(torch.arange(end), _llama3_scaled(freqs)).float()
    return torch.polar(torch.ones_like(angles), angles)


def _freqs_for(freqs_cis: torch.Tensor, z: torch.Tensor, positions: torch.Tensor | None):
    """freqs_cis rows for z [b, s, h, hd/2] (complex), shaped to broadcast against it."""
    b, s, _, half = z.shape
    if positions is None:
        return freqs_cis[:s].view(1, s, 1, half)
    if positions.size(0) == 1:
        return freqs_cis[positions.squeeze(0)].view(1, s, 1, half)
    table = freqs_cis[None, :, None, :].expand(b, -1, -1, -1)
    return torch.gather(table, 1, positions.view(b, s, 1, 1).expand(b, s, 1, half))


def apply_rotary_emb(xq, xk, freqs_cis, positions=None):
    """Rotate q and k by multiplying their (even, odd) pairs, as complex numbers, by cis."""
    q = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    k = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    f = _freqs_for(freqs_cis, q, positions)
    q_out = torch.view_as_real(q * f).flatten(3)
    k_out = torch.view_as_real(k * f).flatten(3)
    return q_out.type_as(xq), k_out.type_as(xk)


class _Attention(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.wq = nn.Linear(dim, heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(heads * self.head_dim, dim, bias=False)

    def forward(self, x, freqs_cis, positions):
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, -1, self.head_dim)
        k = self.wk(x).view(b, s, -1, self.head_dim)
        v = self.wv(x).view(b, s, -1, self.head_dim)
        q, k = apply_rotary_emb(q, k, freqs_cis, positions)
        rep = self.heads // self.kv_heads  # repeat_kv
        k = (
            k.unsqueeze(3)
            .expand(b, s, self.kv_heads, rep, self.head_dim)
            .reshape(b, s, -1, self.head_dim)
        )
        v = (
            v.unsqueeze(3)
            .expand(b, s, self.kv_heads, rep, self.head_dim)
            .reshape(b, s, -1, self.head_dim)
        )
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        return self.wo(out.transpose(1, 2).contiguous().view(b, s, -1))


class _Block(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int, hidden: int) -> None:
        super().__init__()
        self.attention = _Attention(dim, heads, kv_heads)
        self.w1, self.w3 = nn.Linear(dim, hidden, bias=False), nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.attention_norm, self.ffn_norm = nn.RMSNorm(dim, eps=1e-5), nn.RMSNorm(dim, eps=1e-5)

    def forward(self, x, freqs_cis, positions):
        h = x + self.attention(self.attention_norm(x), freqs_cis, positions)
        y = self.ffn_norm(h)
        return h + self.w2(F.silu(self.w1(y)) * self.w3(y))


class TitanLlama3(nn.Module):
    def __init__(
        self, dim=64, layers=2 if FULL else 1, heads=4, kv_heads=2, hidden=128, max_seq_len=32
    ):
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, dim)
        self.register_buffer(
            "freqs_cis", precompute_freqs_cis(dim // heads, max_seq_len), persistent=False
        )
        self.layers = nn.ModuleDict(
            {str(i): _Block(dim, heads, kv_heads, hidden) for i in range(layers)}
        )
        self.norm = nn.RMSNorm(dim, eps=1e-5)
        self.output = nn.Linear(dim, VOCAB, bias=False)

    def forward(self, tokens, positions=None):
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, self.freqs_cis, positions)
        return self.output(self.norm(h))


def _positions(kind: str, b: int = 2, s: int = 8):
    if kind == "none":
        return ()
    rows = 1 if kind == "shared" else b
    return (
        torch.stack(
            [torch.randperm(s, generator=torch.Generator().manual_seed(i)) for i in range(rows)]
        ),
    )


@pytest.mark.parametrize("positions", ["none", "shared", "per_sequence"])
def test_titan_llama3_complex_rotary_is_real_arithmetic_bit_identical_to_eager(positions, tmp_path):
    torch.manual_seed(0)
    model = TitanLlama3().eval()
    inputs = (_ids(), *_positions(positions))
    program = portable.capture(model, inputs)
    freqs = next(i for i in program.signature.inputs if i.target == "freqs_cis")
    assert str(freqs.spec) == "float32[32x8x2]"  # the complex64 buffer as (real, imag) pairs
    assert not any(w.is_complex() for w in program.weights.values())
    assert not {"aten.view_as_complex.default", "aten.view_as_real.default"} & _op_names(program)
    loaded = portable.load(program.save(tmp_path / "llama3.portable"))  # safetensors: real only
    with torch.no_grad():
        want = model(*inputs)
    assert torch.equal(portable.compile(loaded)(*inputs), want)
    assert torch.equal(model.freqs_cis, precompute_freqs_cis(16, 32))  # the model is untouched


@pytest.mark.slow
def test_titan_llama3_parity_on_xla_and_onnx():
    torch.manual_seed(0)
    model = TitanLlama3().eval()
    inputs = (_ids(), *_positions("per_sequence"))
    program = portable.capture(model, inputs)
    backends = ["xla", "onnx"] if FULL else ["xla"]
    report = check_parity(program, inputs, backends=backends, eager_model=model, **INFERENCE_TOL)
    assert report.ok, report.format()


def test_titan_llama3_training_step_equals_eager_and_xla():
    torch.manual_seed(0)
    model = TitanLlama3()
    batch = (_ids(0), _ids(1))
    program = portable.capture(model, batch, loss_fn=_lm_loss, optimizer=portable.optim.SGD(lr=0.1))
    report = check_parity(
        program, batch, backends=["xla"], steps=3, eager_model=model, loss_fn=_lm_loss, **SGD_TOL
    )
    assert report.ok, report.format()
    eager_rows = [r for r in report.rows if r.backend == "eager"]
    assert eager_rows and all(r.max_abs <= 1e-6 for r in eager_rows), report.format()


class _RotaryInForward(nn.Module):
    """freqs_cis computed in forward (torch.polar on a graph value), not a buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 16)

    def forward(self, x):
        angles = torch.outer(
            torch.arange(x.shape[1], dtype=torch.float32), torch.linspace(0.1, 1.0, 8)
        )
        cis = torch.polar(torch.ones_like(angles), angles)
        z = torch.view_as_complex(self.proj(x).reshape(*x.shape[:-1], -1, 2))
        return torch.view_as_real(z * cis + z).flatten(2)


def test_polar_in_forward_matches_eager_to_rounding():
    torch.manual_seed(0)
    model = _RotaryInForward().eval()
    x = torch.randn(2, 6, 16)
    program = portable.capture(model, (x,))
    with torch.no_grad():
        torch.testing.assert_close(portable.compile(program)(x), model(x), rtol=1e-6, atol=1e-6)


class _ComplexCase(nn.Module):
    def __init__(self, case: str) -> None:
        super().__init__()
        self.case = case
        if case == "parameter":
            self.w = nn.Parameter(torch.randn(4, dtype=torch.complex64))

    def forward(self, x):
        if self.case == "input":
            return torch.view_as_real(x * x)
        z = torch.view_as_complex(x.reshape(4, 2))
        if self.case == "output":
            return z * z
        if self.case == "parameter":
            return torch.view_as_real(z * self.w)
        if self.case == "scalar":
            return torch.view_as_real(x * 1j)
        return torch.view_as_real(torch.exp(z))  # an op the rewrite does not take


COMPLEX_REFUSALS = {
    "input": ("input x is complex", "pass torch.view_as_real(x)"),
    "output": ("returns a complex tensor", "return torch.view_as_real(z)"),
    "parameter": ("parameter w is complex", "store it as torch.view_as_real pairs"),
    "op": ("aten.exp.default on complex values is not supported", "write that line with real"),
    "scalar": ("aten.mul.Tensor on a complex Python scalar is not supported", "write that line"),
}


@pytest.mark.parametrize("case", list(COMPLEX_REFUSALS))
def test_complex_values_outside_the_rewrite_are_refused_with_the_fix(case):
    x = torch.randn(4, dtype=torch.complex64) if case == "input" else torch.randn(8)
    with pytest.raises(portable.CaptureError) as info:
        portable.capture(_ComplexCase(case).eval(), (x,))
    what, fix = COMPLEX_REFUSALS[case]
    message = str(info.value)
    assert what in message and f"fix: {fix}" in message, message
    if case == "op":
        assert "test_real_models.py" in message  # the user's line


# --------------------------------------------------------------------------- flex attention


def _causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


class _Flex(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wq = nn.Linear(16, 16)

    def forward(self, x):
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        mask = create_block_mask(_causal, None, None, x.shape[-2], x.shape[-2], device="cpu")
        return flex_attention(self.wq(x), x, x, block_mask=mask)


@pytest.mark.parametrize("trainable", [False, True], ids=["frozen", "trainable"])
def test_flex_attention_is_refused_naming_sdpa(trainable):
    model = _Flex().eval().requires_grad_(trainable)
    with pytest.raises(portable.CaptureError) as info:
        portable.capture(model, (torch.randn(1, 2, 128, 16),))
    message = str(info.value)
    assert "flex attention" in message and "scaled_dot_product_attention" in message, message
    assert "create_mask(mask_mod" in message and "is_causal=True" in message


# Every rule of the complex rewrite on its own: f(x) over a real [2, 3, 8] x, eager vs `cpu`.
def _z(x):
    return torch.view_as_complex(x.reshape(2, 3, 4, 2))


COMPLEX_RULES = {
    "mul_complex": lambda x: torch.view_as_real(_z(x) * _z(x)[:, :, :1]),
    "mul_real_tensor": lambda x: torch.view_as_real(_z(x) * x[..., :4]),
    "mul_scalar": lambda x: torch.view_as_real(_z(x) * 3.0),
    "add_sub": lambda x: torch.view_as_real(_z(x) + _z(x) * 2 - _z(x)[:1]),
    "add_alpha": lambda x: torch.view_as_real(torch.add(_z(x), _z(x)[:, :1], alpha=0.5)),
    "cat_stack": lambda x: torch.view_as_real(
        torch.cat([_z(x), _z(x)[:, :1]], -2) * torch.stack([_z(x)[:, 0]] * 4, 1)
    ),
    "real_to_complex": lambda x: torch.view_as_real(
        x.to(torch.complex64) * _z(x).reshape(2, 3, 4)[..., :1].expand(2, 3, 8)
    ),
    "neg_clone": lambda x: torch.view_as_real(-_z(x).clone()),
    "real_imag": lambda x: _z(x).real * 2 + _z(x).imag,
    "slice_select": lambda x: torch.view_as_real(_z(x)[:, 1:, 2] * _z(x)[:, :2, -1]),
    "index_select": lambda x: torch.view_as_real(_z(x).index_select(-1, torch.tensor([3, 0]))),
    "reshape_view": lambda x: torch.view_as_real(_z(x).reshape(6, 4).view(2, 12)),
    "permute_transpose": lambda x: torch.view_as_real(_z(x).permute(2, -3, 1).transpose(-1, 0)),
    "unsqueeze_expand": lambda x: torch.view_as_real(_z(x).unsqueeze(-2).expand(2, 3, 5, 4)),
    "to_complex128": lambda x: torch.view_as_real(_z(x).to(torch.complex128) * 2),
    "polar": lambda x: torch.view_as_real(torch.polar(x[..., :4].abs(), x[..., 4:])),
}


class _Fn(nn.Module):
    def __init__(self, fn) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


@pytest.mark.parametrize("case", list(COMPLEX_RULES))
def test_complex_rule_matches_eager(case):
    x = torch.randn(2, 3, 8, generator=torch.Generator().manual_seed(0))
    model = _Fn(COMPLEX_RULES[case])
    program = portable.capture(model, (x,))
    assert not any(
        n.meta["tensor"].dtype.is_complex
        for n in program.graph.nodes
        if isinstance(n.meta.get("tensor"), portable.ir.TensorSpec)
    )
    got, want = portable.compile(program)(x), model(x)
    assert got.dtype == want.dtype
    exact = case not in ("polar", "mul_complex")  # rounding of cos/sin, and eager's tail loop
    if exact:
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_titan_llama3_lowers_for_neuron_and_cuda(tmp_path):
    """The rewritten program holds only real opset ops, so the offline targets take it too."""
    torch.manual_seed(0)
    program = portable.capture(TitanLlama3().eval(), (_ids(),))
    for target in ("neuron", "cuda"):
        compiled = portable.lower(program, target, tmp_path / target)
        assert (tmp_path / target / "manifest.json").is_file(), compiled
