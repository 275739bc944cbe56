"""Units: find the model's layer list and assign every node of the captured graph to the
prefix, one layer, or the tail (final norm + LM head + loss)."""

from __future__ import annotations

from collections.abc import Container, Sequence

import torch
import torch.utils.flop_counter
from torch import nn

from rpcompile.capture.types import _WRAPPED
from rpcompile.errors import InvalidInput

# ---------------------------------------------------------------------------------------------
# 3. Units
# ---------------------------------------------------------------------------------------------


def _has_module(model: nn.Module, name: str) -> bool:
    try:
        model.get_submodule(name)
    except AttributeError:
        return False
    return True


def _check_module(model: nn.Module, name: str, what: str) -> None:
    try:
        model.get_submodule(name)
    except AttributeError:
        raise InvalidInput(
            f"{what}=[...] names {name!r}, which is not a submodule of {type(model).__name__}; "
            "use names from model.named_modules()"
        ) from None


def _find_layers(model: nn.Module, units: Sequence[str] | None) -> list[str]:
    """The module names that are one unit each: given, or the children of the largest list."""
    if units is not None:
        for name in units:
            _check_module(model, name, "units")
        return list(units)
    best, best_params = None, 0
    for name, mod in model.named_modules():
        if not isinstance(mod, (nn.ModuleList, nn.Sequential)) or len(mod) < 2:
            continue
        n = sum(p.numel() for p in mod.parameters())
        if n > best_params:
            best, best_params = name, n
    if best is None:
        return []
    container = model.get_submodule(best)
    return [f"{best}.{i}" if best else str(i) for i in range(len(container))]


def _assign_units(
    gm: torch.fx.GraphModule, layer_names: list[str], params: Container[str] | None = None
) -> list[str]:
    """Write ``node.meta['rp_unit']``; return the unit names (prefix, layers..., tail).

    A node inside layer i belongs to unit i+1. A node outside every layer belongs to the
    latest unit among its inputs (it is computed as soon as its inputs exist), except that
    once it depends on the last layer it belongs to the tail. Placeholders belong to the
    prefix; they are re-assigned per use by the split pass.
    """
    prefix_len = len(_WRAPPED) + 1
    owner = {name: i + 1 for i, name in enumerate(layer_names)}
    tail = len(layer_names) + 1
    unit_names = ["prefix", *layer_names, "tail"]

    def layer_of(node: torch.fx.Node) -> int | None:
        for path, _cls in reversed(list((node.meta.get("nn_module_stack") or {}).values())):
            path = path[prefix_len:] if path.startswith(_WRAPPED + ".") else path
            while path:
                if path in owner:
                    return owner[path]
                path = path.rpartition(".")[0]
        return None

    for node in gm.graph.nodes:
        if node.op == "placeholder":
            node.meta["rp_unit"] = 0
            continue
        if node.op == "output":
            node.meta["rp_unit"] = tail
            continue
        from_inputs = max((a.meta["rp_unit"] for a in node.all_input_nodes), default=0)
        layer = layer_of(node)
        if layer is not None and layer >= from_inputs:
            unit = layer
        elif from_inputs >= tail - 1 and tail > 1 and from_inputs > 0:
            unit = tail
        else:
            unit = from_inputs
        node.meta["rp_unit"] = unit
    loss = loss_node(gm)
    if loss.meta["rp_unit"] != tail:
        loss.meta["rp_unit"] = tail
    if params is not None:
        _sink_input_only_nodes(gm, params)
    return unit_names


def loss_node(gm: torch.fx.GraphModule) -> torch.fx.Node:
    """The node of the captured graph's output: the microbatch loss."""
    loss = next(iter(gm.graph.find_nodes(op="output"))).args[0]
    return loss[0] if isinstance(loss, (tuple, list)) else loss


def _sink_input_only_nodes(gm: torch.fx.GraphModule, params: Container[str]) -> None:
    """Move prefix nodes that read no parameter and serve one later unit only (the shifted
    labels, read by the loss) into that unit, so they do not ride through every stage boundary.
    Values read by many units (rotary tables, masks) stay in the prefix as shared values."""
    reads_param: set[torch.fx.Node] = set()
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            if n.name in params:
                reads_param.add(n)
        elif any(a in reads_param for a in n.all_input_nodes):
            reads_param.add(n)
    for n in reversed(list(gm.graph.nodes)):
        if n.op != "call_function" or n.meta["rp_unit"] != 0 or n in reads_param:
            continue
        # Checks with no users (_assert_tensor_metadata) follow their input afterwards.
        users = {u.meta["rp_unit"] for u in n.users if u.op != "output" and u.users}
        if len(users) == 1 and min(users) > 0:  # values read by many units stay shared
            n.meta["rp_unit"] = users.pop()
    for n in gm.graph.nodes:
        if n.op == "call_function" and not n.users and n.all_input_nodes:
            n.meta["rp_unit"] = max(a.meta["rp_unit"] for a in n.all_input_nodes)
