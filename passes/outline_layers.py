"""Outline each repeated layer into a submodule that owns its parameters.

The traced program is one flat graph that reads every weight from the root. FSDP2 shards
and gathers per module, and pipeline stages cut at layer boundaries, so both need each
layer to be a module called by the root. This pass uses ``torch.fx``'s ``split_module`` to
cut the graph into "before the layers", one part per layer, the code between two stacks of
layers (an encoder-decoder's), and "after the layers", then
moves each layer's weights into its part and installs the part at the layer's original path
(``model.layers.3``), so parameter names do not change.
"""

from __future__ import annotations

import torch.fx as fx
from torch import nn
from torch.fx.passes.split_module import split_module

from autopar.core.graph_facts import META_KEY, NodeFacts
from autopar.passes.infra import GraphPass, PassContext, PassResult, register_pass

PRE = 0  # what runs before the first layer


def partition_nodes(gm: fx.GraphModule) -> tuple[dict[fx.Node, int], dict[int, str]]:
    """Node -> partition, and layer partition -> layer path.

    Partitions run in this order: ``0`` before the layers, ``2k + 1`` the ``k``-th layer (in
    the order layers run, over every stack), ``2k + 2`` what runs after it and before the
    next layer. A model with one stack has glue only before and after it; an
    encoder-decoder also has the glue between its two stacks (the encoder's final norm, the
    decoder's embedding and masks), which must run after the encoder's layers and before the
    decoder's. A node outside the layers joins the glue after the latest layer run so far.
    """
    part: dict[fx.Node, int] = {}
    paths: dict[int, str] = {}
    glue = PRE
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        facts = node.meta.get(META_KEY)
        if facts is None:
            # Inserted by an earlier pass (a collective): goes with the node it reads (the
            # latest of them), wherever it was placed in the graph.
            sources = [part[a] for a in node.all_input_nodes if a in part]
            if sources:
                part[node] = max(sources)
                continue
        path = layer_path(facts)
        if path is None:
            part[node] = glue
            continue
        index = 2 * facts.layer + 1
        part[node] = index
        paths[index] = path
        if node.op != "get_attr":
            glue = max(glue, index + 1)
    return part, paths


def layer_path(facts: NodeFacts | None) -> str | None:
    """Module path of the layer a node belongs to (``model.decoder.block.1``), or None.
    ``facts.layer`` counts layers over every stack; the path has the index in its own."""
    if facts is None or facts.block is None or facts.layer is None:
        return None
    index = facts.module_path[len(facts.block) + 1:].split(".")[0]
    return f"{facts.block}.{index}"


def _glue_name(index: int, last: int) -> str:
    if index == PRE:
        return "before_layers"
    return "after_layers" if index > last else f"between_layers_{index // 2 - 1}"


def _install(root: nn.Module, path: str, value: nn.Module | nn.Parameter) -> None:
    owner_path, _, attr = path.rpartition(".")
    owner = root
    for name in owner_path.split(".") if owner_path else []:
        if not hasattr(owner, name):
            owner.add_module(name, nn.Module())
        owner = getattr(owner, name)
    if isinstance(value, nn.Parameter):
        owner.register_parameter(attr, value)
    elif isinstance(value, nn.Module):
        owner.add_module(attr, value)
    else:
        owner.register_buffer(attr, value)


@register_pass
class OutlineLayers(GraphPass):
    name = "outline-layers"

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        part, paths = partition_nodes(gm)
        if not paths:
            return PassResult(gm, modified=False)
        new = split_module(gm, gm, lambda n: part.get(n, PRE), keep_original_order=True,
                           keep_original_node_name=True)
        new.graph._codegen = gm.graph._codegen  # immutable pytree specs: share, never deepcopy
        for attr in ("_in_spec", "_out_spec"):
            if hasattr(gm, attr):
                setattr(new, attr, getattr(gm, attr))
        changes = []
        for node in list(new.graph.nodes):
            if node.op != "call_module" or not str(node.target).startswith("submod_"):
                continue
            index = int(str(node.target).removeprefix("submod_"))
            if index not in paths:  # the code before, between and after the layers
                name = _glue_name(index, max(paths))
                new.add_module(name, getattr(new, str(node.target)))
                delattr(new, str(node.target))
                node.target = name
                continue
            path = paths[index]
            sub = getattr(new, str(node.target))
            moved = self._move_weights(new, node, sub, path)
            delattr(new, str(node.target))
            _install(new, path, sub)
            node.target = path
            changes.append(f"layer {path}: outlined with {moved} weights")
        _restore_aliases(gm, new)
        new.meta["autopar_layer_paths"] = [paths[i] for i in sorted(paths)]
        new.graph.eliminate_dead_code()
        new.graph.lint()
        new.recompile()
        return PassResult(new, modified=True, changes=changes)

    @staticmethod
    def _move_weights(root: fx.GraphModule, call: fx.Node, sub: fx.GraphModule, path: str) -> int:
        """Make ``sub`` own the weights only it reads, at their paths relative to ``path``."""
        placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
        keep_args = []
        moved = 0
        for arg, placeholder in zip(call.args, placeholders):
            target = str(arg.target) if isinstance(arg, fx.Node) and arg.op == "get_attr" else ""
            only_here = isinstance(arg, fx.Node) and all(u is call for u in arg.users)
            if target.startswith(path + ".") and only_here:
                relative = target[len(path) + 1 :]
                value = root.get_parameter(target) if _is_param(root, target) else root.get_buffer(target)
                _install(sub, relative, value)
                with sub.graph.inserting_before(placeholder):
                    got = sub.graph.get_attr(relative)
                got.meta = dict(placeholder.meta)
                placeholder.replace_all_uses_with(got)
                sub.graph.erase_node(placeholder)
                moved += 1
            else:
                keep_args.append(arg)
        call.args = tuple(keep_args)
        sub.recompile()
        return moved


def _restore_aliases(old: nn.Module, new: nn.Module) -> None:
    """Keep every name a tied weight had (``transformer.wte.weight`` and ``lm_head.weight``):
    split_module only copies the names the graph reads."""
    present = {id(p) for p in new.parameters()}
    names = {n for n, _ in new.named_parameters(remove_duplicate=False)}
    for name, p in old.named_parameters(remove_duplicate=False):
        if name not in names and id(p) in present:
            _install(new, name, p)


def _is_param(root: nn.Module, target: str) -> bool:
    try:
        root.get_parameter(target)
        return True
    except AttributeError:
        return False
