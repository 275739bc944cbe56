"""Replicated layers: export the first few structurally identical layers, then copy their
graph for the rest, so a 94-layer model captures in seconds."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.utils.flop_counter
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.fx._lazy_graph_module import _LazyGraphModule

from rpcompile.capture.types import _WRAPPED

# ---------------------------------------------------------------------------------------------
# 3b. Replicated layers: export the first few identical layers, copy their graph for the rest
# ---------------------------------------------------------------------------------------------


class _NotRepeatable(Exception):
    """The exported layers are not copies of each other; capture exports every layer."""


@dataclass(frozen=True)
class _Repeat:
    container: str  # module name of the layer list ("" for a root nn.Sequential)
    count: int  # layers in the model
    period: int  # layer kinds repeat with this period (GPT-OSS alternates: 2)
    exported: int  # layers actually exported (two periods)


def _layer_signature(model: nn.Module, layer: nn.Module, i: int) -> tuple:
    params = tuple((n, tuple(p.shape), p.dtype, p.requires_grad) for n, p in layer.named_parameters())
    buffers = tuple(n for n, _ in layer.named_buffers())
    kinds = getattr(getattr(model, "config", None), "layer_types", None)
    kind = kinds[i] if isinstance(kinds, (list, tuple)) and i < len(kinds) else None
    return (type(layer).__name__, params, buffers, kind, getattr(layer, "attention_type", None))


def _repeat_plan(model: nn.Module, layer_names: list[str]) -> _Repeat | None:
    """How to capture by replication, or None when layers are too few or not periodic."""
    if len(layer_names) < 8:
        return None
    container, _, first = layer_names[0].rpartition(".")
    if not container:
        return None  # a root nn.Sequential: no parent to swap a shorter layer list into
    if first != "0" or layer_names != [f"{container}.{i}" if container else str(i)
                                       for i in range(len(layer_names))]:
        return None
    layers = list(model.get_submodule(container)) if container else list(model)
    if any(_layer_signature(model, lay, 0)[2] for lay in layers):
        return None  # per-layer buffers would need copying too; export them all instead
    sigs = [_layer_signature(model, lay, i) for i, lay in enumerate(layers)]
    for period in (1, 2, 3, 4):
        if len(sigs) % period == 0 and all(sigs[i] == sigs[i % period] for i in range(len(sigs))):
            exported = 2 * period
            if len(sigs) >= exported + 4:
                return _Repeat(container, len(sigs), period, exported)
            return None
    return None


@contextlib.contextmanager
def _truncated(model: nn.Module, repeat: _Repeat):
    parent_name, _, attr = repeat.container.rpartition(".")
    parent = model.get_submodule(parent_name) if repeat.container else None
    if parent is None:
        raise _NotRepeatable("a root nn.Sequential is exported whole")
    full = getattr(parent, attr)
    setattr(parent, attr, nn.ModuleList(list(full)[: repeat.exported]))
    try:
        yield
    finally:
        setattr(parent, attr, full)


def _replicate(gm: torch.fx.GraphModule, params: dict[str, str], model: nn.Module,
               repeat: _Repeat) -> torch.fx.GraphModule:
    """A graph of ``repeat.count`` layers from the export of the first ``repeat.exported``.

    Layer i (i >= exported) is a copy of template layer ``period + i % period``: its parameters
    become new placeholders, inputs from the template's previous layer come from layer i-1
    (matched by position, the layers being structurally equal), inputs from the prefix stay.
    ``params`` gains the new placeholders. Raises _NotRepeatable if layers differ.
    """
    P, K, L = repeat.period, repeat.exported, repeat.count
    nodes = list(gm.graph.nodes)
    by_unit: dict[int, list[torch.fx.Node]] = {}
    for n in nodes:
        if n.op == "call_function":
            by_unit.setdefault(n.meta["rp_unit"], []).append(n)
    layer_nodes = [by_unit.get(i + 1, []) for i in range(K)]
    for i in range(P, K):
        a, b = layer_nodes[i - P], layer_nodes[i]
        if [n.target for n in a] != [n.target for n in b]:
            raise _NotRepeatable(f"layers {i - P} and {i} traced to different graphs")
    prefix_fqn = (repeat.container + "." if repeat.container else "")
    param_of = {n: params[n.name] for n in nodes if n.op == "placeholder" and n.name in params}

    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    placeholders = [n for n in nodes if n.op == "placeholder"]
    last_param = max((i for i, n in enumerate(placeholders) if n in param_of), default=-1)
    new_params: dict[int, dict[torch.fx.Node, torch.fx.Node]] = {}
    canonical = {id(p): name for name, p in model.named_parameters()}

    def add_layer_params(i: int, template: int) -> None:
        mapping = {}
        t_prefix = f"{prefix_fqn}{template}."
        for ph, fqn in param_of.items():
            if fqn.startswith(t_prefix):
                name = f"{prefix_fqn}{i}." + fqn[len(t_prefix):]
                new = graph.placeholder(f"p_rp_{name.replace('.', '_')}")
                new.meta = dict(ph.meta)
                new.meta["val"] = _fresh_like(ph.meta["val"], {})
                params[new.name] = canonical[id(model.get_parameter(name))]
                mapping[ph] = new
        new_params[i] = mapping

    for idx, n in enumerate(placeholders):
        env[n] = graph.node_copy(n)
        if idx == last_param:
            for i in range(K, L):
                add_layer_params(i, P + i % P)
    tail = [n for n in nodes if n.op == "call_function" and n.meta["rp_unit"] > K]
    for n in nodes:
        if n.op == "call_function" and n.meta["rp_unit"] <= K:
            env[n] = graph.node_copy(n, lambda a: env[a])
    new_layers = [[env[n] for n in lay] for lay in layer_nodes]
    position = {n: (i, k) for i, lay in enumerate(layer_nodes) for k, n in enumerate(lay)}

    for i in range(K, L):
        template = P + i % P
        t_nodes = layer_nodes[template]
        storages: dict[int, torch.Tensor] = {}
        local: dict[torch.fx.Node, torch.fx.Node] = {}

        def remap(a: torch.fx.Node, i=i, template=template, local=local) -> torch.fx.Node:
            if a in local:
                return local[a]
            if a in new_params[i]:
                return new_params[i][a]
            if a in position:
                src, k = position[a]
                if src != template - 1:
                    raise _NotRepeatable(
                        f"layer {template} reads layer {src}, not only the layer before it"
                    )
                return new_layers[i - 1][k]
            if a.op == "placeholder" and a in param_of and param_of[a].startswith(prefix_fqn):
                raise _NotRepeatable(f"layer {template} reads another layer's parameter")
            return env[a]

        copies = []
        for n in t_nodes:
            new = graph.node_copy(n, remap)
            new.meta = _renamed_meta(n.meta, f"{prefix_fqn}{template}", f"{prefix_fqn}{i}")
            if "val" in n.meta:
                new.meta["val"] = _fresh_like(n.meta["val"], storages)
            new.meta["rp_unit"] = i + 1
            local[n] = new
            copies.append(new)
        new_layers.append(copies)

    last = layer_nodes[K - 1]
    last_index = {n: k for k, n in enumerate(last)}

    def remap_tail(a: torch.fx.Node) -> torch.fx.Node:
        if a in last_index:
            return new_layers[L - 1][last_index[a]]
        if a in position:
            raise _NotRepeatable("the tail reads a layer other than the last")
        return env[a]

    for n in tail:
        env[n] = graph.node_copy(n, remap_tail)
    out = next(iter(gm.graph.find_nodes(op="output")))
    graph.output(torch.fx.map_arg(out.args[0], remap_tail))
    for n in graph.nodes:
        n.meta.pop("rp_unit", None)
    # Its Python code is written when it is first run or read (the capture rewrites it
    # further, and planning reads and forks it, running only the stage programs split from it).
    return _LazyGraphModule(gm, graph)


def _renamed_meta(meta: dict, old: str, new: str) -> dict:
    meta = dict(meta)
    stack = meta.get("nn_module_stack")
    if stack:
        wrapped_old, wrapped_new = f"{_WRAPPED}.{old}", f"{_WRAPPED}.{new}"
        renamed = {}
        for key, (path, cls) in stack.items():
            if path == wrapped_old or path.startswith(wrapped_old + "."):
                path = wrapped_new + path[len(wrapped_old):]
            renamed[key] = (path, cls)
        meta["nn_module_stack"] = renamed
    return meta


def _fresh_like(val, storages: dict[int, torch.Tensor]):
    """A new value like ``val`` on new storage; views of one storage stay views of one.

    A fake value is built on the meta device and wrapped as a fake tensor of ``val``'s mode,
    outside the mode's dispatch: with symbolic sizes that is about ten times faster than
    allocating through the mode, and replication makes thousands of these.
    """
    if isinstance(val, (tuple, list)):
        return type(val)(_fresh_like(v, storages) for v in val)
    if not isinstance(val, torch.Tensor):
        return val
    mode = getattr(val, "fake_mode", None)
    key = val.untyped_storage()._cdata
    base = storages.get(key)
    if base is None or base.dtype != val.dtype:
        nbytes = val.untyped_storage().nbytes()
        base = torch.empty(nbytes // val.element_size(), dtype=val.dtype,
                           device="meta" if mode is not None else val.device)
        storages[key] = base
    view = base.as_strided(val.shape, val.stride(), val.storage_offset())
    return view if mode is None else FakeTensor(mode, view, val.device)
