"""The parallelism acceptance matrix shared by the torch.distributed and XLA tests: the plans
for the GPT and Llama examples and for Hugging Face models (end of file), the single-device
reference run and the comparison.

Comparison: loss per step and every parameter after the steps within 1e-5 (atol and rtol).
One documented exception: elements whose gradients are rounding noise. AdamW divides the first
moment by sqrt(v_hat) + eps, so where a gradient is within a hundred eps of zero (GPT's fused
qkv bias slice for k, whose exact gradient is zero since softmax is unchanged when the same
value is added to every score of a query; a weight whose gradient sums to 5e-8 of terms of
1e-3) any change in summation order (a split batch, a split matmul, another CPU's vector width)
changes the noise, and AdamW turns it into a different fraction of lr. Those elements, found
from the reference's second moment, are compared within 2 * lr * steps, the most AdamW moves them apart.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

import portable
from portable import Mesh, Plan
from portable import parallel as par
from portable.ir.program import Program

STEPS = 5
PLAN_NAMES = ("dp", "tp", "dp_tp", "fsdp")


def tp_rules(stem: str) -> list:
    if stem == "gpt":
        return [
            *par.column_parallel(r"blocks\.\d+\.attn\.qkv"),
            *par.row_parallel(r"blocks\.\d+\.attn\.proj"),
            *par.column_parallel(r"blocks\.\d+\.mlp\.fc"),
            *par.row_parallel(r"blocks\.\d+\.mlp\.proj"),
        ]
    if stem == "llama":
        return [
            *par.head_parallel(r"blocks\.\d+\.attn", heads=4, kv_heads=2, axis_size=2),
            *par.column_parallel(r"blocks\.\d+\.mlp\.(gate|up)_proj", bias=False),
            *par.row_parallel(r"blocks\.\d+\.mlp\.down_proj"),
        ]
    raise KeyError(stem)


def plan_for(stem: str, name: str, rules: Callable[[str], list] = tp_rules) -> Plan:
    """Plan `name` for model `stem`, its tensor-parallel rules from `rules(stem)`."""
    if name == "dp":
        return Plan(Mesh({"dp": 2}), batch_axes=("dp",))
    if name == "tp":
        return Plan(Mesh({"tp": 2}), rules=rules(stem))
    if name == "dp_tp":
        return Plan(Mesh({"dp": 2, "tp": 2}), rules=rules(stem), batch_axes=("dp",))
    if name == "fsdp":
        return Plan(Mesh({"dp": 2}), batch_axes=("dp",), fsdp_axis="dp")
    if name == "dp_tp_vocab":  # + the embedding table split on the vocabulary (tied in GPT)
        table = "wte" if stem == "gpt" else "embed"
        vocab = rules(stem) + par.vocab_parallel(table)
        return Plan(Mesh({"dp": 2, "tp": 2}), rules=vocab, batch_axes=("dp",))
    if name == "dp_tp_sp":  # + sequence parallelism over tp
        return Plan(
            Mesh({"dp": 2, "tp": 2}),
            rules=rules(stem),
            batch_axes=("dp",),
            sequence_parallel="tp",
        )
    raise KeyError(name)


def training_program(spec: portable.ModelSpec, seed: int = 0) -> tuple[Program, list[torch.Tensor]]:
    """The single-device training step of an example and its global flat inputs (state, batch)."""
    torch.manual_seed(seed)
    model = spec.build()
    program = portable.capture_spec(spec, training=True, model=model)
    torch.manual_seed(seed + 1)
    batch = list(spec.batch())
    state = [program.weights[i.target] for i in program.signature.state_inputs]
    return program, [*state, *batch]


def reference(program: Program, flat: list[torch.Tensor], steps: int = STEPS):
    """(losses per step, final outputs by name) of the single-device program on cpu."""
    sig = program.signature
    index = {i.name: k for k, i in enumerate(sig.inputs)}
    current = list(flat)
    losses = []
    outs: tuple = ()
    for _ in range(steps):
        outs = program.graph_module(*current)
        losses.append(outs[0].clone())
        for out, value in zip(sig.outputs, outs, strict=True):
            if out.aliases:
                current[index[out.aliases]] = value
    return losses, {o.name: v for o, v in zip(sig.outputs, outs, strict=True)}


# the examples' optimizer (AdamW, portable.optim defaults)
ADAMW_LR, ADAMW_BETA2 = 1e-3, 0.999
NOISE_GRADIENT = 1e-6  # sqrt(v_hat) below this (100 eps): the update amplifies rounding noise


def noise_elements(want_outputs: dict, name: str, steps: int) -> torch.Tensor:
    """The elements of the updated parameter `name` whose gradients are rounding noise."""
    v = want_outputs.get("optimizer." + name.removesuffix(".updated") + ".exp_avg_sq.updated")
    if v is None:
        return torch.zeros(want_outputs[name].shape, dtype=torch.bool)
    return (v / (1 - ADAMW_BETA2**steps)).sqrt() < NOISE_GRADIENT


def assert_updated_close(
    got: torch.Tensor, want: torch.Tensor, noise: torch.Tensor, name: str, steps: int
) -> None:
    """`got` equals `want` within 1e-5, and within 2 * lr * steps where `noise` is set (each
    AdamW step moves an element by about lr at most, in either run)."""
    assert got.shape == want.shape, name
    torch.testing.assert_close(got[~noise], want[~noise], atol=1e-5, rtol=1e-5, msg=name)
    bound = 2 * ADAMW_LR * steps
    torch.testing.assert_close(got[noise], want[noise], atol=bound, rtol=0, msg=name)


def assert_matches(stem: str, want: tuple, got_losses, got_outputs: dict) -> None:
    """Losses and every updated parameter equal the single-device run within 1e-5."""
    want_losses, want_outputs = want
    assert len(got_losses) == len(want_losses)
    for step, (w, g) in enumerate(zip(want_losses, got_losses, strict=True)):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5, msg=f"loss of step {step}")
    checked = 0
    for name, w in want_outputs.items():
        if not name.endswith(".updated") or name.startswith("optimizer."):
            continue
        steps = len(want_losses)
        noise = noise_elements(want_outputs, name, steps)
        assert_updated_close(got_outputs[name], w, noise, name, steps)
        checked += 1
    assert checked > 0


# --------------------------------------------------------------------------- Hugging Face models
#
# Stock models built from small configs (tests/conftest.py `hf_model`), default (SDPA)
# attention: Hugging Face builds the causal (Mistral: sliding-window) mask from arange / full /
# expand sized by the global batch, which the pass must carry to the local batch.

HF_MODELS = ("llama", "qwen2", "mistral", "gpt2", "bert")
HF_PLAN_NAMES = ("dp", "tp", "dp_tp")
HF_BATCH = (4, 16)  # global batch, sequence: dp=2 leaves 2 sequences per rank
# SGD, not AdamW: AdamW divides each gradient by its own magnitude, so a gradient off by a
# constant factor (a reduction missing or done twice) moves the parameters almost as the right
# one does; SGD's step is the gradient scaled by lr, so parameters within 1e-5 check gradients.
HF_OPTIMIZER = portable.optim.SGD(lr=0.3, momentum=0.9)


def hf_tp_rules(name: str) -> list:
    """Tensor-parallel presets with the Hugging Face module names of each family."""
    if name in ("llama", "qwen2", "mistral"):
        stem = r"model\.layers\.\d+"
        return [
            *par.head_parallel(
                rf"{stem}\.self_attn", heads=4, kv_heads=2, axis_size=2, bias=name == "qwen2"
            ),
            *par.column_parallel(rf"{stem}\.mlp\.(gate|up)_proj", bias=False),
            *par.row_parallel(rf"{stem}\.mlp\.down_proj"),
        ]
    if name == "gpt2":  # Conv1D stores [in, out]; the fused c_attn cannot be head-parallel
        stem = r"transformer\.h\.\d+"
        return [
            *par.column_parallel(rf"{stem}\.(attn\.c_attn|mlp\.c_fc)", transposed=True),
            *par.row_parallel(rf"{stem}\.(attn|mlp)\.c_proj", transposed=True),
        ]
    if name == "bert":  # the output projection lives in a sibling module: attention.output
        stem = r"bert\.encoder\.layer\.\d+"
        return [
            *par.head_parallel(
                rf"{stem}\.attention",
                heads=4,
                axis_size=2,
                q=r"self\.query",
                k=r"self\.key",
                v=r"self\.value",
                o=r"output\.dense",
                bias=True,
            ),
            *par.column_parallel(rf"{stem}\.intermediate\.dense"),
            *par.row_parallel(rf"{stem}\.output\.dense"),
        ]
    raise KeyError(name)


def hf_plan_for(name: str, plan: str) -> Plan:
    return plan_for(name, plan, hf_tp_rules)


def hf_lm_loss(model, idx, targets):
    return torch.nn.functional.cross_entropy(model(idx).logits.flatten(0, 1), targets.flatten())


def hf_training_program(model: torch.nn.Module, seed: int = 1):
    """The single-device training step of a Hugging Face model and its global flat inputs."""
    torch.manual_seed(seed)
    batch = tuple(torch.randint(0, 128, HF_BATCH) for _ in range(2))
    program = portable.capture(model, batch, loss_fn=hf_lm_loss, optimizer=HF_OPTIMIZER)
    state = [program.weights[i.target] for i in program.signature.state_inputs]
    return program, [*state, *batch]


def run_on_gloo(program: Program, flat: list[torch.Tensor], per_rank: Program, tmp_path) -> tuple:
    """(losses per step, final state as `<weight>.updated` outputs) of `per_rank` trained STEPS
    steps on mesh-size gloo processes (`portable.distributed.launch`) from `program`'s global
    inputs `flat`; every rank must hold the same loss."""
    import safetensors.torch

    from portable.distributed.launch import launch, prepare

    sig = program.signature
    users = {u.name: v for u, v in zip(sig.inputs, flat, strict=True) if u in sig.user_inputs}
    world = per_rank.plan.mesh.size
    results = launch(
        prepare(per_rank, users, tmp_path / "run", steps=STEPS), world, tmp_path / "out"
    )
    assert results["world_size"] == world and results["steps"] == STEPS
    assert results["loss_spread"] == 0.0  # every rank holds the same (replicated) loss
    state = safetensors.torch.load_file(tmp_path / "out" / "state.safetensors")
    losses = [torch.tensor(v) for v in results["losses"]]
    return losses, {f"{key}.updated": value for key, value in state.items()}
