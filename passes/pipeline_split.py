"""Cut the program into pipeline stages at layer boundaries.

Runs after :class:`OutlineLayers`: the root then calls ``before_layers``, one module per
layer, and ``after_layers``. The layers are cut into ``pp x virtual`` contiguous chunks
as the plan cuts them (``plan.pipeline.chunks``; which rank runs which chunk is the
runtime's business); what runs before the layers joins the first chunk, what runs after
them the last. Each chunk becomes a GraphModule ``stage_<c>`` whose inputs are exactly the
previous chunk's outputs — ``torch.distributed.pipelining`` passes nothing else between
stages — so a value a later chunk needs (the targets, say) is carried through the chunks in
between, made contiguous so that it can be sent (values made from the inputs alone, such as
attention masks, are not carried: :class:`RecomputeInputs` gave each layer its own). Weights read by several chunks (a tied embedding and output head) are read by each
of them; the runtime sums their gradients across the stages that hold them. The root is
rewritten to call the stages in order, so the split program still runs in one process.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from autopar.core.errors import PlanError
from autopar.passes.infra import GraphPass, PassContext, PassResult, register_pass


def chunk_of_layers(pipeline: dict, n_layers: int, chunks: int) -> list[int]:
    """Chunk of each layer (in order), from the plan's ``pipeline.chunks`` cut."""
    entries = pipeline.get("chunks") or []
    out: list[int] = []
    for c, entry in enumerate(entries):
        first, last = entry["layers"]
        if first != len(out) or last < first:
            raise PlanError(f"pipeline chunk {c} covers layers {first}-{last}, but the "
                            f"previous chunks end at layer {len(out) - 1}",
                            where=f"plan.pipeline.chunks[{c}]",
                            fix="chunks must cut the layers contiguously, in order; re-plan")
        out += [c] * (last - first + 1)
    if len(entries) != chunks or len(out) != n_layers:
        raise PlanError(
            f"the plan cuts {len(out)} layers into {len(entries)} chunks, but this program "
            f"has {n_layers} layers and {chunks} chunks (pp x virtual_stages)",
            where="plan.pipeline.chunks",
            fix="re-plan for this model (autopar plan ... --json FILE)",
        )
    return out


def sendable(value: object) -> object:
    """A value as a stage sends it: gloo sends only contiguous tensors (an expanded or
    transposed view is not), and the next stage allocates its receive buffer alike."""
    return value.contiguous() if isinstance(value, torch.Tensor) else value


def _is_tensor(node: fx.Node) -> bool:
    return isinstance(node.meta.get("val"), torch.Tensor)


@register_pass
class PipelineSplit(GraphPass):
    name = "pipeline-split"
    requires = ("outline-layers",)

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        pp = ctx.plan.mesh.get("pp", 1)
        virtual = int(ctx.plan.pipeline.get("virtual_stages", 1) or 1)
        paths = list(gm.meta.get("autopar_layer_paths", []))
        chunks = pp * virtual
        if chunks <= 1:
            return PassResult(gm, modified=False)
        layer_chunk = dict(zip(paths, chunk_of_layers(ctx.plan.pipeline, len(paths), chunks)))
        stage = self._assign(gm, layer_chunk, chunks)
        new, outputs = self._build(gm, stage, chunks)
        new.meta["autopar_pipeline"] = {
            "chunks": chunks, "pp": pp, "virtual": virtual, "outputs": outputs,
            "layers": {c: [p for p, k in layer_chunk.items() if k == c] for c in range(chunks)},
        }
        changes = [f"stage_{c}: layers {', '.join(new.meta['autopar_pipeline']['layers'][c])}"
                   for c in range(chunks)]
        return PassResult(new, modified=True, changes=changes)

    @staticmethod
    def _assign(gm: fx.GraphModule, layer_chunk: dict[str, int], chunks: int) -> dict:
        """Chunk of every root node (weights read by several chunks are handled apart)."""
        stage: dict[fx.Node, int] = {}
        for node in gm.graph.nodes:
            if node.op in ("placeholder", "output", "get_attr"):
                continue
            if node.op == "call_module" and node.target in layer_chunk:
                stage[node] = layer_chunk[node.target]
            elif node.op == "call_module" and node.target == "before_layers":
                stage[node] = 0
            elif node.op == "call_module" and node.target == "after_layers":
                stage[node] = chunks - 1
            else:
                inputs = [stage[a] for a in node.all_input_nodes if a in stage]
                stage[node] = max(inputs, default=0)
        return stage

    @staticmethod
    def _build(gm: fx.GraphModule, stage: dict, chunks: int) -> tuple[fx.GraphModule, dict]:
        graph = gm.graph
        placeholders = [n for n in graph.nodes if n.op == "placeholder"]
        constants = {p: p.meta.get("val") for p in placeholders if not _is_tensor(p)}
        out_args = list(graph.output_node().args[0])
        returned = [a for a in out_args if isinstance(a, fx.Node) and a in stage]
        # Values: tensor inputs (they enter at chunk 0) and what each chunk computes.
        defined = {p: 0 for p in placeholders if _is_tensor(p)}
        defined.update(stage)
        readers: dict[fx.Node, set[int]] = {v: set() for v in defined}
        for node, k in stage.items():
            for a in node.all_input_nodes:
                if a in readers:
                    readers[a].add(k)
        for a in returned:
            readers[a].add(chunks - 1)
        ordered = [v for v in graph.nodes if v in defined]
        carry_in = [[p for p in ordered if p.op == "placeholder" and readers[p]]]
        for k in range(1, chunks):
            carry_in.append([v for v in ordered
                             if defined[v] < k and readers[v] and max(readers[v]) >= k])

        stage_modules = []
        for k in range(chunks):
            sub = fx.Graph()
            env: dict[fx.Node, fx.Node] = {}
            for v in carry_in[k]:
                env[v] = sub.placeholder(v.name)
                env[v].meta = dict(v.meta)
            for node in graph.nodes:
                if stage.get(node) != k:
                    continue
                for a in node.all_input_nodes:
                    if a not in env and a.op == "get_attr":
                        env[a] = sub.get_attr(a.target)  # each chunk reads the weights it uses
                        env[a].meta = dict(a.meta)
                env[node] = sub.node_copy(
                    node, lambda a, env=env: env[a] if a in env else constants[a])
            if k < chunks - 1:
                sub.output(tuple(sub.call_function(sendable, (env[v],)) for v in carry_in[k + 1]))
            else:
                sub.output(tuple(env[v] for v in returned))
            stage_modules.append(fx.GraphModule(gm, sub, class_name=f"Stage{k}"))

        root = fx.Graph()
        env = {}
        for p in placeholders:
            env[p] = root.placeholder(p.name)
            env[p].meta = dict(p.meta)
        carried = [env[p] for p in carry_in[0]]
        for k, module in enumerate(stage_modules):
            gm.add_module(f"stage_{k}", module)
            call = root.call_module(f"stage_{k}", tuple(carried))
            values = carry_in[k + 1] if k < chunks - 1 else returned
            carried = [root.call_function(operator.getitem, (call, i)) for i in range(len(values))]
            env.update(zip(values, carried))
        root.output(type(graph.output_node().args[0])(
            env.get(a, a) if isinstance(a, fx.Node) else a for a in out_args))
        root._codegen = gm.graph._codegen
        new = fx.GraphModule(gm, root)
        for attr in ("_in_spec", "_out_spec"):
            if hasattr(gm, attr):
                setattr(new, attr, getattr(gm, attr))
        new.meta.update(gm.meta)
        return new, {"returned": [a.name for a in returned],
                     "inputs": [p.name for p in carry_in[0]]}


