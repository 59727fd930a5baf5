"""Models named by a string, as `portable plan SPEC` takes them: presets, `transformer:` specs and
Hugging Face config files.

    resolve("llama3-70b")                          # a preset: transformers.LlamaConfig
    resolve("gpt3-175b")                           # a preset: planner.Transformer
    resolve("transformer:layers=2,hidden=256,heads=4,vocab=1000,seq=128")
    resolve("path/to/config.json", seq=4096)       # or the folder holding it

A preset is a value: its name, what it is, the sequence length it was trained at (the default
`seq`) and a factory; nothing is built, and transformers is not imported, until it is resolved.
The Llama 3 sizes are those of Meta's published Hugging Face configs (Llama 3 and 3.1 share
them); GPT-3 175B is Brown et al. 2020, Table 2.1, in planner.Transformer's Megatron-LM form.

Config files come from elsewhere: the file is read within portable.limits' JSON bounds, a
config that asks for code (`auto_map`) or names a model type transformers does not know as a
causal LM is refused, no code is loaded (`trust_remote_code=False`, nothing downloaded), and
every size the planner would allocate or enumerate from is bounded (`BOUNDS`). Each refusal is
a PlannerError that says what to change.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

from ..errors import PlannerError
from ..safe_json import read_json
from .models import hf_transformer
from .transformer import Transformer

__all__ = ["BOUNDS", "PRESETS", "Preset", "Resolved", "preset", "presets", "resolve"]


@dataclasses.dataclass(frozen=True)
class Preset:
    """A named model: `build()` returns a `transformers` config or a `planner.Transformer`."""

    name: str
    description: str
    seq: int  # the training sequence length: the default `seq`
    factory: Callable[[], Any]

    def build(self) -> Any:
        """The model description the planner takes (PlannerError when transformers is missing)."""
        return self.factory()


@dataclasses.dataclass(frozen=True)
class Resolved:
    """What a SPEC names: the planner's model description and the figures to show with it."""

    spec: str
    kind: str  # "preset", "config" or "transformer"
    name: str
    model: Any  # a planner.Transformer or a transformers config
    seq: int
    heads: int
    parameters: int


# The largest sizes a SPEC may give (capture allocates token ids of `seq`; the search enumerates
# over layers and heads): far above any published model, far below what would exhaust the host.
BOUNDS: Mapping[str, int] = MappingProxyType(
    {
        "layers": 1024,
        "hidden": 1 << 17,
        "heads": 1024,
        "kv_heads": 1024,
        "vocab": 1 << 22,
        "seq": 1 << 20,
        "ffn": 1 << 20,
        "experts": 4096,
        "top_k": 4096,
    }
)
_HF_SIZES = {  # the planner's names of the config fields it reads
    "layers": "num_hidden_layers",
    "hidden": "hidden_size",
    "heads": "num_attention_heads",
    "vocab": "vocab_size",
    "ffn": "intermediate_size",
}
_TRANSFORMER_FORM = "transformer:layers=L,hidden=H,heads=A,vocab=V,seq=S[,ffn=F,kv_heads=K,...]"


def _transformers(why: str) -> Any:
    try:
        import transformers
    except ImportError as exc:
        raise PlannerError(
            f"{why} needs transformers, which is not installed here",
            fix="pip install 'portable[hf]'",
        ) from exc
    return transformers


def _llama3(name: str, hidden: int, ffn: int, layers: int, heads: int) -> Callable[[], Any]:
    def build() -> Any:
        transformers = _transformers(f"preset {name} (a Hugging Face config)")
        return transformers.LlamaConfig(
            hidden_size=hidden,
            intermediate_size=ffn,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=8,
            vocab_size=128256,
            max_position_embeddings=8192,
            rms_norm_eps=1e-5,
            rope_theta=500000.0,
            bos_token_id=128000,
            eos_token_id=128001,
            tie_word_embeddings=False,
            use_cache=False,  # a training step keeps no key/value cache
            name_or_path=name,
        )

    return build


def _gpt3_175b() -> Transformer:
    return Transformer(layers=96, hidden=12288, heads=96, vocab=51200, seq=2048, name="gpt3-175b")


PRESETS: Mapping[str, Preset] = MappingProxyType(
    {
        p.name: p
        for p in (
            Preset(
                "llama3-8b",
                "Llama 3 8B: 32 layers, hidden 4096, 32 heads (8 KV), SwiGLU 14336",
                8192,
                _llama3("llama3-8b", 4096, 14336, 32, 32),
            ),
            Preset(
                "llama3-70b",
                "Llama 3 70B: 80 layers, hidden 8192, 64 heads (8 KV), SwiGLU 28672",
                8192,
                _llama3("llama3-70b", 8192, 28672, 80, 64),
            ),
            Preset(
                "llama3-405b",
                "Llama 3.1 405B: 126 layers, hidden 16384, 128 heads (8 KV), SwiGLU 53248",
                8192,
                _llama3("llama3-405b", 16384, 53248, 126, 128),
            ),
            Preset(
                "gpt3-175b",
                "GPT-3 175B: 96 layers, hidden 12288, 96 heads, GeLU 4h (Megatron-LM's form)",
                2048,
                _gpt3_175b,
            ),
        )
    }
)


def presets() -> tuple[str, ...]:
    """The preset names."""
    return tuple(PRESETS)


def preset(name: str) -> Preset:
    """The preset `name`; PlannerError naming the closest one and listing all otherwise."""
    key = name.strip().lower()
    if key in PRESETS:
        return PRESETS[key]
    raise _unknown(name)


def _unknown(name: str) -> PlannerError:
    close = difflib.get_close_matches(name.strip().lower(), PRESETS, n=1)
    hint = f" (closest: {close[0]})" if close else ""
    return PlannerError(
        f"unknown model {name!r}{hint}",
        fix=f"name a preset ({', '.join(PRESETS)}), a Hugging Face config.json or its folder, "
        f"or {_TRANSFORMER_FORM}",
    )


# --------------------------------------------------------------------------- resolve a SPEC


def resolve(spec: str, *, seq: int | None = None) -> Resolved:
    """The model `spec` names: `transformer:k=v,...` (planner.Transformer's fields), a preset
    name, or the path of a Hugging Face config.json (or of its folder; `./NAME` for a folder
    named like a preset). `seq` overrides the spec's own sequence length; a config file has
    none, so it needs one. PlannerError for anything else (module docstring)."""
    if seq is not None:
        _bounded("seq", seq, "seq")
    if spec.startswith("transformer:"):
        return _of_transformer(spec, "transformer", parse_transformer(spec), seq)
    if spec.strip().lower() in PRESETS:
        chosen = PRESETS[spec.strip().lower()]
        model = chosen.build()
        if isinstance(model, Transformer):
            return _of_transformer(spec, "preset", model, seq)
        return _of_config(spec, "preset", chosen.name, model, seq or chosen.seq)
    path = Path(spec)
    if path.exists():
        if seq is None:
            raise PlannerError(
                f"{spec} is a Hugging Face config, which has no training sequence length",
                fix="pass --seq S (seq=S from Python)",
            )
        return _of_config(spec, "config", str(path), load_config(path), seq)
    if "/" in spec or spec.endswith(".json"):
        raise PlannerError(f"{spec}: no such file or folder", fix="check the config's path")
    raise _unknown(spec)


def _of_transformer(spec: str, kind: str, model: Transformer, seq: int | None) -> Resolved:
    if seq is not None and seq != model.seq:
        model = dataclasses.replace(model, seq=seq)
    name = model.name or spec
    return Resolved(spec, kind, name, model, model.seq, model.heads, model.parameters)


def _of_config(spec: str, kind: str, name: str, config: Any, seq: int) -> Resolved:
    shape = hf_transformer(config, seq)
    return Resolved(spec, kind, name, config, seq, shape.heads, shape.parameters)


def parse_transformer(spec: str) -> Transformer:
    """`transformer:layers=48,hidden=6144,heads=64,vocab=51200,seq=2048[,ffn=...,...]` as a
    planner.Transformer: each key one of its fields, ints as digits, booleans 0/1/true/false."""
    body = spec.removeprefix("transformer:")
    pairs = [p.partition("=") for p in body.split(",")] if body else []
    if not pairs or any(not re.fullmatch(r"[a-z_]+=[A-Za-z0-9._-]+", "".join(p)) for p in pairs):
        raise PlannerError(
            f"{spec!r} is not a transformer spec", fix=f"write it as {_TRANSFORMER_FORM}"
        )
    fields = {f.name: str(f.type) for f in dataclasses.fields(Transformer)}
    values: dict[str, Any] = {}
    for key, _, text in pairs:
        if key not in fields:
            raise PlannerError(
                f"{spec!r}: Transformer has no field {key!r}", fix=f"use {', '.join(fields)}"
            )
        if key in values:
            raise PlannerError(f"{spec!r} gives {key} twice", fix="give each field once")
        values[key] = _value(key, text, fields[key])
    missing = [k for k in ("layers", "hidden", "heads", "vocab", "seq") if k not in values]
    if missing:
        raise PlannerError(
            f"{spec!r} lacks {', '.join(missing)}", fix=f"write it as {_TRANSFORMER_FORM}"
        )
    return Transformer(**values)


def _value(key: str, text: str, annotation: str) -> Any:
    kinds = annotation.replace(" ", "").split("|")
    if "bool" in kinds:
        flags = {"1": True, "true": True, "0": False, "false": False}
        if text.lower() not in flags:
            raise PlannerError(f"transformer spec: {key}={text}", fix=f"{key} is 0 or 1")
        return flags[text.lower()]
    if "int" in kinds:
        if not text.isdigit():
            raise PlannerError(f"transformer spec: {key}={text}", fix=f"{key} is an integer")
        return _bounded(key, int(text), key)
    if "float" in kinds:
        try:
            number = float(text)
        except ValueError:
            number = math.nan
        if not math.isfinite(number):
            raise PlannerError(f"transformer spec: {key}={text}", fix=f"{key} is a number")
        return number
    return text


def _bounded(key: str, value: int, where: str) -> int:
    limit = BOUNDS.get(key)
    if limit is not None and value > limit:
        raise PlannerError(
            f"{where}={value} is over the planner's bound of {limit}",
            fix=f"pass a {key} of at most {limit}",
        )
    return value


# --------------------------------------------------------------------------- config files


def load_config(path: Path) -> Any:
    """The Hugging Face config at `path` (a config.json, or the folder holding one), checked as
    the module docstring says; its key/value cache is off (the planner prices a training step)."""
    file = path / "config.json" if path.is_dir() else path
    fix = "pass a Hugging Face causal-LM config.json (or its folder), as save_pretrained writes"
    doc = read_json(file, PlannerError, fix=fix)
    if not isinstance(doc, dict):
        raise PlannerError(f"{file} holds a JSON {type(doc).__name__}, not an object", fix=fix)
    if "auto_map" in doc:
        raise PlannerError(
            f"{file} asks for the model's own code (auto_map); the planner runs no code from "
            "a config",
            fix=f"give its sizes as {_TRANSFORMER_FORM}",
        )
    transformers = _transformers(f"the config {file}")
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_type = doc.get("model_type")
    if not isinstance(model_type, str) or model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise PlannerError(
            f"{file}: model_type {model_type!r} is not a causal language model transformers "
            f"{transformers.__version__} knows",
            fix=f"pass a causal LM's config (llama, mistral, qwen2, ...), or {_TRANSFORMER_FORM}",
        )
    try:
        config = transformers.AutoConfig.from_pretrained(
            str(file), trust_remote_code=False, local_files_only=True
        )
    except Exception as exc:  # the file is untrusted: any refusal of it is the user's error
        first = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__
        raise PlannerError(f"{file} is not a config transformers reads: {first}", fix=fix) from exc
    for key, attribute in _HF_SIZES.items():
        value = getattr(config, attribute, None)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise PlannerError(f"{file}: {attribute}={value!r}", fix=f"{attribute} >= 1")
        _bounded(key, value, attribute)
    config.use_cache = False  # a training step keeps no key/value cache
    return config
