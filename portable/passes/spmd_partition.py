"""`spmd-partition`: a single-device program + its plan -> the per-rank program.

Every rank runs the same per-rank program on its local shards. The pass

1. gives each input the sharding the plan asks for (`spmd/layouts.py`: specs and rules per
   parameter, FSDP over a data axis, the batch split over data axes, optimizer state following
   its parameter);
2. walks the graph in order and, per op, asks its sharding rule (`spmd/rules/`) which shardings
   the inputs must have and which the result gets; the collectives that bring an input to the
   required sharding are inserted before the op (`spmd/redistribute.py`), each followed by its
   own `portable.wait`; size arguments become local sizes, and a replicated value a split
   consumer needs (a mask built from the global batch's sizes) is recomputed at the local size
   where its producers allow (`spmd/localize.py`), else sliced with `local_shard`;
3. brings each output to its required sharding: the loss replicated (in a training step that is
   where gradients computed from a split batch are summed: the gradient is a partial sum until the
   optimizer update, which needs it split like its parameter: an all-reduce, or a reduce-scatter
   under FSDP), updated parameters and optimizer state as their inputs;
4. re-derives every shape with the ops' fake kernels from the local input shapes.

A mean loss over a split batch is computed as a global sum divided by a global count
(`nll_loss` with reduction=mean is rewritten as reduction=sum / total_weight first), so ranks
with unequal numbers of ignored targets still give the single-device loss.

Supported and tested: data parallelism (`batch_axes`), tensor parallelism (column/row/head
parallel presets), both together on a 2-D mesh, and FSDP (`fsdp_axis`), on the GPT, Llama and MLP
examples' training steps and inference programs, and on stock Hugging Face Llama, Qwen2, Mistral,
GPT-2 and BERT with SDPA attention (tests/test_spmd_hf.py). Ops without a rule run on full copies (correct,
counted as `replicated-ops`). Context parallelism (`context_axis`, spmd/context.py): user inputs
split on the sequence too, causal attention given an explicit mask first, flattened tokens kept
in place (spmd/merges.py), keys and values all-gathered for attention, their gradients
reduce-scattered (`_scatter_key_gradient`); tested on the GPT and Llama examples with cp and
dp x cp (tests/test_context_parallel.py). Expert parallelism and pipelines are refused here.

The per-rank program records its layout contract in `Program.spmd` (a `SpmdLayout`, see
`portable/ir/spmd.py` and docs/parallelism.md): the mesh, every input's and output's
sharding and global shape, and the collectives inserted. Counts: one per collective kind and
axis (`all_reduce[dp]`), `bytes[<op>:<axis>]` the bytes each rank sends, `replicated-ops`
(ops without a rule, run on full copies) and `localized` (replicated values recomputed at the
local size for a split consumer, named in the notes).
"""

from __future__ import annotations

import dataclasses
import functools
import operator
from collections import Counter
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensorMode

from portable.errors import PassError, PlanError
from portable.ir.fake_calls import FakeCalls
from portable.ir.plan import Mesh
from portable.ir.program import Program
from portable.ir.rewriter import Rewriter, replaced_args
from portable.ir.sharding import Sharding
from portable.ir.signature import (
    InputKind,
    InputSpec,
    OutputKind,
    OutputSpec,
    Signature,
    TensorSpec,
)
from portable.ir.spmd import Collective, SpmdLayout, TensorLayout
from portable.opset.bind import bind
from portable.opset.table import CAST, PERMUTE, RESHAPE, ops_with

from .base import Pass, PassReport, PassResult
from .spmd.context import carried_merges, causal_masks, check_context_plan
from .spmd.layouts import input_shardings
from .spmd.merges import Merge
from .spmd.redistribute import Redistributor
from .spmd.rules import RULES, Decision, RuleContext, replicate_all
from .spmd.rules.base import Key, ResultSharding, single

__all__ = ["SpmdPartition", "partition"]

aten = torch.ops.aten
NAME = "spmd-partition"
_ATTENTION_BACKWARD = (
    torch.ops.portable.attention_backward.default,
    torch.ops.portable.attention_backward.mask_grad,
)


@dataclasses.dataclass(frozen=True)
class SpmdPartition(Pass):
    """Partition the program over its plan's mesh (module doc). No options: the plan is the
    program's own (`capture(..., plan=...)` or `program.replace(plan=...)`)."""

    name = NAME

    def apply(self, program: Program) -> PassResult:
        plan = program.plan
        unplanned = [
            what
            for what, named in (
                ("experts (expert parallelism)", plan.experts),
                ("pipeline (run it with split_stages / its engine)", plan.pipeline),
            )
            if named is not None
        ]
        if unplanned:
            raise PlanError(
                f"the spmd-partition pass does not act on the plan's {', '.join(unplanned)}",
                fix="drop it from the plan: a pipeline runs through passes/pipeline_split.py "
                "(portable run / portable train); expert parallelism is not implemented yet",
            )
        check_context_plan(plan)
        if plan.is_single_device:
            return PassResult(
                program, self.report(False, notes=["single-device plan: nothing to do"])
            )
        if program.spmd is not None:
            raise PassError(
                f"{program.name} is already partitioned",
                pass_name=NAME,
                fix="apply spmd-partition once, to the single-device program",
            )
        if program.metadata.get("symbolic_dims"):
            raise PassError(
                f"{program.name} has dynamic dims {sorted(program.metadata['symbolic_dims'])}",
                pass_name=NAME,
                fix="partition a program captured with static shapes",
            )
        plan.validate(program.tensor_shapes())
        return _Partitioner(program, self).run()


def partition(program: Program) -> tuple[Program, PassReport]:
    """`(per-rank program, report)` of `program` under `program.plan`."""
    result = SpmdPartition().apply(program)
    return result.program, result.report


class _Partitioner:
    def __init__(self, program: Program, owner: SpmdPartition) -> None:
        self.owner = owner
        self.src = program
        self.out = program.replace()
        self.graph = self.out.graph
        self.rewriter = Rewriter(self.graph)
        mesh = program.plan.mesh
        assert mesh is not None, "SpmdPartition.apply partitions only multi-device plans"
        self.mesh: Mesh = mesh
        self.notes: list[str] = []
        self.replicated_ops: Counter[str] = Counter()
        self.red = Redistributor(self.graph, self.mesh, NAME)
        self.ctx = RuleContext(
            self.mesh,
            self.red.sharding,
            self.red.global_shape,
            self.red.dtype,
            program.plan.sequence_parallel,
            _parameter_values(self.graph, program),
            program.plan.context_axis,
            self.red.merged,
        )

    def run(self) -> PassResult:
        _mean_losses_as_sums(self.graph)
        if self.ctx.context_axis is not None:
            masked = causal_masks(self.graph)
            if masked:
                self.notes.append(
                    "context parallelism: causal attention given an explicit mask of its "
                    "local query rows: " + ", ".join(masked)
                )
        _infer_meta(self.graph)
        shardings = input_shardings(self.out, self.notes)
        for node in list(self.graph.nodes):
            if node.op == "placeholder":
                self._record(node, shardings[node.name])
            elif node.op == "call_function":
                self._partition(node)
            elif node.op == "output":
                self._outputs(node)
        self.graph.eliminate_dead_code()
        local_inputs = {
            n.name: shardings[n.name].local_shape(self.red.global_shape[n], self.mesh)
            for n in self.graph.nodes
            if n.op == "placeholder"
        }
        _infer_meta(self.graph, local_inputs)
        self.graph.lint()
        self.out.graph_module.recompile()
        self._signature_and_metadata(shardings)
        return PassResult(self.out, self._report())

    # ------------------------------------------------------------------------ per node

    def _record(
        self,
        node: torch.fx.Node,
        sharding: ResultSharding,
        merged: Sequence[dict[int, Merge]] = (),
    ) -> None:
        """Record `node`'s sharding (its global shape and dtype from its spec) and the merged
        dims of its result(s)."""
        self.red.sharding[node] = sharding
        meta = node.meta["tensor"]
        if isinstance(meta, TensorSpec):
            self.red.global_shape[node] = tuple(int(s) for s in meta.shape)
            self.red.dtype[node] = meta.dtype
        if node.target is operator.getitem:
            source, index = node.args
            items = self.red.merged_items.get(source)  # type: ignore[arg-type]
            if items and isinstance(index, int) and items[index]:
                self.red.merged[node] = items[index]
        elif isinstance(sharding, tuple) and any(merged):
            self.red.merged_items[node] = tuple(merged)
        elif merged and merged[0]:
            self.red.merged[node] = merged[0]

    def _partition(self, node: torch.fx.Node) -> None:
        if node.target is aten.linalg_vector_norm.default and self._split_norm(node):
            return
        self._gather_fsdp_parameter(node)
        rule = RULES.get(node.target)
        if rule is not None:
            decision = rule(self.ctx, node)
        else:
            decision = replicate_all(self.ctx, node)
            if node.target is not operator.getitem:
                self.replicated_ops[str(node.target)] += 1
        if decision.split_addmm:
            self._split_addmm(node)
            return
        wanted, merged = self._merges(node, decision)
        for key, want in decision.inputs.items():
            arg = _input(node, key)
            if isinstance(arg, torch.fx.Node) and arg in self.red.sharding:
                self._set_input(node, key, self.red.to(arg, want, node, wanted.get(key)))
        if decision.args:
            self.rewriter.set_args(node, decision.args)
        vocab_axis = decision.vocab_parallel
        if vocab_axis is not None:
            node = _masked_lookup(self.graph, node, vocab_axis, self.mesh.axis_size(vocab_axis))
            self.red.global_shape[node] = tuple(node.meta["tensor"].shape)
            self.red.dtype[node] = node.meta["tensor"].dtype
        self._record(node, decision.output, merged)
        self._scatter_key_gradient(node)

    def _merges(
        self, node: torch.fx.Node, decision: Decision
    ) -> tuple[dict[Key, dict[int, Merge]], list[dict[int, Merge]]]:
        """The merged dims (spmd/merges.py) `node`'s inputs must have and its results get: those
        its inputs carry through the dims the rule keeps, and those the rule makes (a reshape)."""
        inputs = []
        for key, want in decision.inputs.items():
            arg = _input(node, key)
            if isinstance(arg, torch.fx.Node) and arg in self.red.global_shape:
                shape = self.red.global_shape[arg]
                inputs.append((key, shape, want, self.red.merged.get(arg, {})))
        out, meta = decision.output, node.meta.get("tensor")
        pairs: list[tuple[tuple[int, ...], Sharding] | None] = []
        if isinstance(out, Sharding) and isinstance(meta, TensorSpec):
            pairs.append((tuple(int(d) for d in meta.shape), out))
        elif isinstance(out, tuple) and isinstance(meta, tuple):
            for s, m in zip(out, meta, strict=True):
                if isinstance(s, Sharding) and isinstance(m, TensorSpec):
                    pairs.append((tuple(int(d) for d in m.shape), s))
                else:
                    pairs.append(None)
        wanted, merged = carried_merges(inputs, pairs)
        if decision.merged is not None and merged:
            merged[0] = {**merged[0], **decision.merged}
        elif decision.merged:
            merged = [dict(decision.merged)]
        return wanted, merged

    def _scatter_key_gradient(self, node: torch.fx.Node) -> None:
        """Context parallelism: dk and dv of a split-query attention are partial sums over the
        context axis (every rank's queries reach every key): reduce-scatter them onto the
        sequence at once, so what consumes them (the rotary backward, the projections' backward)
        runs on this rank's tokens."""
        axis = self.ctx.context_axis
        if axis is None or node.target is not operator.getitem:
            return
        source, index = node.args
        if getattr(source, "target", None) not in _ATTENTION_BACKWARD or index not in (1, 2):
            return
        have = self.red.sharding[node]
        if not isinstance(have, Sharding) or have.partial_op(axis) != "sum" or have.dims[2]:
            return
        dims = have.dims[:2] + ((axis,),) + have.dims[3:]
        want = Sharding(dims, tuple(p for p in have.partial if p[0] != axis))
        try:
            want.local_shape(self.red.global_shape[node], self.mesh)
        except PlanError:
            return  # the sequence does not divide: consumers reduce it as they need
        users = list(node.users)
        scattered = self.red.to(node, want, node.next)
        for user in users:
            user.replace_input_with(node, scattered)

    def _set_input(self, node: torch.fx.Node, key: Key, value: torch.fx.Node) -> None:
        """Pass `value` as `node`'s input `key` (an argument, or an element of a list one)."""
        if isinstance(key, str):
            self.rewriter.set_args(node, {key: value})
            return
        name, index = key
        items = list(bind(node)[name])
        items[index] = value
        self.rewriter.set_args(node, {name: items})

    def _gather_fsdp_parameter(self, node: torch.fx.Node) -> None:
        """FSDP: a view of a parameter (`t(W)` feeding a matmul) views the gathered parameter,
        so the all-gather is of the parameter itself (what comm-overlap prefetches)."""
        axis = self.src.plan.fsdp_axis
        if axis is None or node.target not in _PARAMETER_VIEWS:
            return
        param = bind(node).get("self")
        if not isinstance(param, torch.fx.Node) or param.op != "placeholder":
            return
        have = self.red.sharding.get(param)
        if not self.ctx.is_parameter(param) or not isinstance(have, Sharding):
            return
        if axis not in have.axes():
            return
        want = Sharding(tuple(tuple(a for a in d if a != axis) for d in have.dims), have.partial)
        self.rewriter.set_args(node, {"self": self.red.to(param, want, node)})

    def _split_norm(self, node: torch.fx.Node) -> bool:
        """||x||_2 of a split or partial x (a gradient, in clip_grad_norm):

            norm(x) -> sqrt(all_reduce(sum(x_local * x_local)))

        so ranks reduce one scalar per norm instead of gathering or all-reducing x whole. A
        partial x is first brought to the sharding of the parameter it is the gradient of
        (`meta["norm_like"]`, set by capture: a reduce-scatter under FSDP), and x's later users
        read that reduced value too (the optimizer update needs it in that sharding anyway).
        False (the op's ordinary rule applies) for other norms and for replicated x."""
        bound = bind(node)
        x = bound.node("self")
        have = self.red.sharding.get(x)
        full = bound.get("dim") in (None, [], ()) and not bound.keepdim and bound.dtype is None
        if not (full and bound.ord == 2 and isinstance(have, Sharding)):
            return False
        if not have.partial and not have.axes():
            return False
        like = self._placeholder(node.meta.get("norm_like"))
        param = self.red.sharding.get(like) if like is not None else None
        want = Sharding((param if isinstance(param, Sharding) else have).dims)
        local = self.red.to(x, want, node)
        if local is not x:
            order = {n: i for i, n in enumerate(self.graph.nodes)}
            for user in list(x.users):
                if user is not local and order.get(user, -1) > order[node]:
                    user.replace_input_with(x, local)
        scalar = TensorSpec((), self.red.dtype[x])
        with self.rewriter.at(before=node):
            square = self.rewriter.call(
                aten.mul.Tensor, (local, local), like=node, tensor=x.meta["tensor"], fake="none",
                name=None,
            )  # fmt: skip
            total = self.rewriter.call(
                aten.sum.default, (square,), like=node, tensor=scalar, fake="none", name=None
            )
            root = self.rewriter.call(
                aten.sqrt.default, (total,), like=node, tensor=scalar, fake="none", name=None
            )
        node.replace_all_uses_with(root)
        self.graph.erase_node(node)
        for new in (square, total, root):
            self.red.global_shape[new] = (
                tuple(new.meta["tensor"].shape) if new is not square else self.red.global_shape[x]
            )
            self.red.dtype[new] = self.red.dtype[x]
            self._partition(new)
        return True

    def _placeholder(self, name: Any) -> torch.fx.Node | None:
        if not isinstance(name, str):
            return None
        return next((n for n in self.graph.nodes if n.op == "placeholder" and n.name == name), None)

    def _split_addmm(self, node: torch.fx.Node) -> None:
        """bias + a @ b whose product is a partial sum: mm, then add the bias after the reduce."""
        bound = bind(node)
        bias, a, b = bound.node("self"), bound.node("mat1"), bound.node("mat2")
        if bound.beta != 1 or bound.alpha != 1:
            raise PassError("addmm with alpha/beta is not partitioned", pass_name=NAME)
        with self.rewriter.at(before=node):  # both carry the addmm's value, spec and source
            mm = self.rewriter.call(aten.mm.default, (a, b), **self._as(node))
            add = self.rewriter.call(aten.add.Tensor, (mm, bias), **self._as(node))
        for new in (mm, add):
            if "val" in node.meta:
                new.meta["val"] = node.meta["val"]
        node.replace_all_uses_with(add)
        self.graph.erase_node(node)
        self._partition(mm)
        self._partition(add)

    @staticmethod
    def _as(node: torch.fx.Node) -> dict[str, Any]:
        """`Rewriter.call` options for a node that stands in for `node` mid-pass: its spec and
        source, torch.fx's naming, no fake value (values are inferred after the pass)."""
        return {"like": node, "tensor": node.meta.get("tensor"), "fake": "none", "name": None}

    def _outputs(self, node: torch.fx.Node) -> None:
        sig = self.out.signature
        inputs = {i.name: i for i in sig.inputs}
        placeholders = {n.name: n for n in self.graph.nodes if n.op == "placeholder"}
        values = _output_values(node)
        self.output_shardings: dict[str, Sharding] = {}
        for i, (spec, value) in enumerate(zip(sig.outputs, values, strict=True)):
            if not isinstance(value, torch.fx.Node):
                continue
            have = single(value, self.red.sharding[value])
            if spec.aliases and spec.aliases in inputs:
                alias = placeholders[spec.aliases]
                want = single(alias, self.red.sharding[alias])
            elif spec.kind in (OutputKind.LOSS, OutputKind.METRIC):
                want = Sharding.replicated(len(have.dims))
            else:
                want = Sharding(have.dims)
            values[i] = self.red.to(value, want, node)
            self.output_shardings[spec.name] = want
        node.args = (tuple(values),)

    # ------------------------------------------------------------------------ results

    def _signature_and_metadata(self, shardings: dict[str, Sharding]) -> None:
        sig = self.out.signature
        local = {n.name: n.meta["tensor"] for n in self.graph.nodes if n.op == "placeholder"}
        out_values = _output_values(self.graph.output_node())
        inputs = tuple(InputSpec(i.name, i.kind, local[i.name], i.target) for i in sig.inputs)
        outputs = tuple(
            OutputSpec(o.name, o.kind, v.meta["tensor"], o.target, o.aliases)
            for o, v in zip(sig.outputs, out_values, strict=True)
        )
        self.out.signature = Signature(inputs, outputs)
        self.out.spmd = SpmdLayout(
            self.mesh,
            tuple(_layout(i, shardings[i.name]) for i in sig.inputs),
            tuple(_layout(o, self.output_shardings[o.name]) for o in sig.outputs),
            tuple(self._live_collectives()),
        )

    def _live_collectives(self) -> list[Collective]:
        live = {n.name for n in self.graph.nodes}
        return [c for c in self.red.collectives if c.node in live]

    def _report(self) -> PassReport:
        counts: Counter[str] = Counter()
        nbytes: Counter[str] = Counter()
        for c in self._live_collectives():
            counts[f"{c.op}[{c.axis}]"] += 1
            nbytes[f"bytes[{c.op}:{c.axis}]"] += c.bytes
        counts.update(nbytes)
        counts["replicated-ops"] = sum(self.replicated_ops.values())
        counts["localized"] = len(self.red.localized)
        notes = list(self.notes)
        if self.red.localized:
            notes.append(
                "built at the local size instead of sliced from a global copy: "
                + ", ".join(self.red.localized)
            )
        for c in self._live_collectives():
            notes.append(f"{c.node}: {c.op} over {c.axis} ({c.group_size} ranks), {c.bytes} bytes")
        if self.replicated_ops:
            top = ", ".join(f"{k} x{v}" for k, v in self.replicated_ops.most_common())
            notes.append(f"ops without a sharding rule ran on full copies: {top}")
        return self.owner.report(True, dict(counts), notes)


# ---------------------------------------------------------------------------- graph helpers


def _layout(spec: InputSpec | OutputSpec, sharding: Sharding) -> TensorLayout:
    """The layout of a signature value of the global program (its shape is the global one)."""
    return TensorLayout(spec.name, sharding, tuple(int(d) for d in spec.spec.shape))


def _input(node: torch.fx.Node, key: Key) -> Any:
    """`node`'s argument `key`: a schema name, or (name, index) into a list argument."""
    bound = bind(node)
    if isinstance(key, str):
        return bound[key]
    name, index = key
    return bound[name][index]


def _output_values(output: torch.fx.Node) -> list[Any]:
    """The values the graph's output node returns (the verifier checks they are a sequence)."""
    (values,) = output.args
    assert isinstance(values, (tuple, list)), f"the graph returns {values!r}, not a tuple"
    return list(values)


_PARAMETER_VIEWS = ops_with(PERMUTE, RESHAPE, CAST) | {
    aten.expand.default,
    aten.unsqueeze.default,
    aten.clone.default,
}


def _parameter_values(graph: torch.fx.Graph, program: Program) -> frozenset[torch.fx.Node]:
    """Parameter placeholders and the views / casts computed from them alone."""
    names = {i.name for i in program.signature.inputs_of(InputKind.PARAMETER)}
    found: set[torch.fx.Node] = set()
    for node in graph.nodes:
        if node.op == "placeholder" and node.name in names:
            found.add(node)
        elif node.target in _PARAMETER_VIEWS and bind(node).get("self") in found:
            found.add(node)
    return frozenset(found)


def _masked_lookup(graph: torch.fx.Graph, node: torch.fx.Node, axis: str, n: int) -> torch.fx.Node:
    """embedding(W_shard, ids) -> the vocabulary-parallel lookup on this rank's rows:

        start = local_shard(arange(V), 0, axis, n)[0]        this rank's first vocabulary id
        local = ids - start; hit = (local >= 0) & (local < V / n)
        out = embedding(W_shard, local * hit) * hit[..., None]    a partial sum over `axis`

    Returns the node computing `out` (which replaces `node`). The backward needs no change: the
    dense gradient of the whole table is sliced to this rank's rows by the optimizer update."""
    bound = bind(node)
    weight, ids = bound.node("weight"), bound.node("indices")
    vocab = int(weight.meta["tensor"].shape[0]) if "tensor" in weight.meta else None
    if vocab is None:
        raise PassError(
            "vocabulary-parallel embedding without a recorded table shape", pass_name=NAME
        )
    rows = vocab // n
    rewriter = Rewriter(graph)

    def call(
        target: Any, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None
    ) -> torch.fx.Node:
        return rewriter.call(target, args, kwargs, like=node, fake="none", name=None)

    with rewriter.at(before=node):
        every = call(aten.arange.start_step, (0, vocab, 1), {"dtype": torch.int64})
        mine = call(torch.ops.portable.local_shard.default, (every, 0, axis, n))
        start = call(aten.select.int, (mine, 0, 0))
        local = call(aten.sub.Tensor, (ids, start))
        low = call(aten.ge.Scalar, (local, 0))
        high = call(aten.lt.Scalar, (local, rows))
        hit = call(aten.bitwise_and.Tensor, (low, high))
        safe = call(aten.mul.Tensor, (local, hit))
        rows_out = call(aten.embedding.default, *replaced_args(node, {"indices": safe}))
        keep = call(aten.unsqueeze.default, (hit, -1))
        out = call(aten.mul.Tensor, (rows_out, keep))
    out.meta["tensor"] = node.meta["tensor"]
    node.replace_all_uses_with(out)
    graph.erase_node(node)
    return out


def _mean_losses_as_sums(graph: torch.fx.Graph) -> None:
    """nll_loss(reduction=mean) -> nll_loss(reduction=sum) / total_weight (the same arithmetic
    as ATen's kernel), so a split batch reduces to the global mean exactly."""
    rewriter = Rewriter(graph)
    for node in list(graph.nodes):
        if node.target is not aten.nll_loss_forward.default or bind(node).reduction != 1:
            continue
        rewriter.set_args(node, {"reduction": 2})
        getters = {bind(u).literal("index"): u for u in node.users if u.target is operator.getitem}
        if 0 not in getters:
            continue
        if 1 not in getters:
            with rewriter.at(after=node):
                getters[1] = rewriter.call(operator.getitem, (node, 1), fake="none", name=None)
        first = max(getters.values(), key=lambda n: list(graph.nodes).index(n))
        with rewriter.at(after=first):
            mean = rewriter.call(
                aten.div.Tensor, (getters[0], getters[1]), like=node, fake="none", name=None
            )
        getters[0].replace_all_uses_with(
            mean, delete_user_cb=functools.partial(operator.is_not, mean)
        )


def _infer_meta(
    graph: torch.fx.Graph, local_inputs: dict[str, tuple[int, ...]] | None = None
) -> None:
    """Set meta["tensor"] / meta["val"] of every node by running the fake kernels, from the
    placeholders' recorded specs (or `local_inputs` shapes)."""
    mode = FakeTensorMode(allow_non_fake_inputs=False)
    calls = FakeCalls(mode)  # a deep model's layers repeat the same calls
    env: dict[torch.fx.Node, Any] = {}

    def load(value: torch.fx.node.Argument) -> Any:
        return torch.fx.node.map_arg(value, lambda n: env[n])

    for node in graph.nodes:
        if node.op == "placeholder":
            spec = node.meta["tensor"]
            shape = local_inputs[node.name] if local_inputs is not None else spec.shape
            with mode:
                env[node] = torch.empty(tuple(shape), dtype=spec.dtype)
        elif node.op == "call_function":
            args, kwargs = load(node.args), load(node.kwargs)
            if node.target is operator.getitem:
                results, index = args
                env[node] = results[index]
            else:
                try:
                    env[node] = calls(node.target, args, kwargs)
                except Exception as exc:
                    raise PlanError(
                        f"the partitioned program is inconsistent at {node.name} "
                        f"({node.target}): {exc}",
                        fix="report the program and plan; meanwhile shard fewer tensors",
                    ) from exc
        else:
            continue
        value = env[node]
        node.meta["val"] = value
        node.meta["tensor"] = _spec(value)


def _spec(value: Any) -> TensorSpec | tuple[Any, ...] | None:
    if isinstance(value, torch.Tensor):
        return TensorSpec.of(value)
    if isinstance(value, (tuple, list)):
        return tuple(_spec(v) for v in value)
    return None
