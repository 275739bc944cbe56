"""The suite's capture cache: a compile of a model that an earlier test of the same worker
captured already, built the same way and given the same example batch, reuses that capture
instead of exporting it again (``torch.export`` of a tiny Hugging Face model costs seconds,
most of the suite's CPU time), rebound to the new model's weights.

What the key holds: everything the export reads except values it never reads (it traces
fake tensors; the graph names the parameters and buffers it takes as inputs): the model's
class, every module's class, ``forward``, training flag and attributes (configs, sizes, plain
tensors with their bytes, since those become the graph's constants; functions by their code
and closures), each parameter's name, shape, dtype, device, type and ``requires_grad`` and
which names share one tensor, each buffer's name, shape, dtype and bytes, the example batch's
structure with each tensor's shape and dtype (sizes 0 and 1 specialize, and the sizes are
the symbols' hints), the ``loss_fn`` (code and closure), ``units``, ``opaque`` and the default
dtype. An object the key can only name by identity is kept alive with the stored capture, so
its id cannot name another object later. A model with hooks is captured every time, and so is
a capture that warns (a hit would not warn again), one with opaque blocks (they hold the
model's modules) or one with quantized weights (their packed state is the model's).

A hit hands out a fork of the stored capture (``Captured.fork``: the passes rewrite their own
copy) with the new model, its example batch, its ``requires_grad`` flags and its dropout seed.
``RPCOMPILE_TEST_CAPTURE_CACHE=0`` turns the cache off; ``=check`` captures afresh on every hit
as well and fails the test where the two captures differ in any node, name, shape, symbol or
constant (docs/contributing.md says when to run the suite that way).
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import os
import types
import warnings
from collections import OrderedDict
from typing import Any

import torch
from torch import nn

_MODE = os.environ.get("RPCOMPILE_TEST_CAPTURE_CACHE", "1")
_LIMIT = 64  # captures kept per worker process (least recently used dropped first)
_STORE: OrderedDict[tuple, Any] = OrderedDict()


class _Unkeyed(Exception):
    """The model holds something the key does not know how to read: capture it afresh."""


def _tensor_key(t: torch.Tensor) -> tuple:
    if t.device.type != "cpu" or t.is_sparse or t.is_quantized or (type(t) is not torch.Tensor \
            and not isinstance(t, nn.Parameter)):
        raise _Unkeyed(f"a {type(t).__qualname__} on {t.device}")
    data = t.detach().contiguous()
    digest = repr(data.tolist()) if data.dtype == torch.bool or not data.numel() else \
        hashlib.blake2b(data.reshape(-1).view(torch.uint8).numpy().tobytes(),
                        digest_size=16).hexdigest()
    return ("tensor", type(t).__qualname__, tuple(t.shape), str(t.dtype), str(t.device),
            t.requires_grad, digest)


def _batch_key(batch: Any) -> Any:
    """The example batch's structure and each tensor's shape and dtype: export turns the
    batch into fake tensors and never reads its values (a hit keeps the new batch's values as
    its example batch); the shapes stay in the key, since export specializes sizes 0 and 1
    and they are the symbols' hints."""
    if isinstance(batch, torch.Tensor):
        return ("tensor", tuple(batch.shape), str(batch.dtype), str(batch.device),
                batch.requires_grad)
    if isinstance(batch, dict):
        return ("dict", tuple((k, _batch_key(v)) for k, v in batch.items()))
    if isinstance(batch, (tuple, list)):
        return (type(batch).__name__, tuple(_batch_key(v) for v in batch))
    if batch is None or isinstance(batch, (bool, int, float, str)):
        return (type(batch).__name__, batch)
    raise _Unkeyed(f"a batch of type {type(batch).__qualname__}")


def _contents(cell: Any) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # a closure variable not bound yet
        return _Unbound


class _Unbound:
    """The value of an empty closure cell."""


class _Keyer:
    """Builds hashable descriptions of values. An object it can only name by identity (a
    class, a code object, an object with no ``__dict__``) is kept alive in ``pinned`` as long
    as a stored capture's key holds its id, so the id cannot name another object later."""

    def __init__(self) -> None:
        self.pinned: list[Any] = []

    def ident(self, v: Any) -> int:
        self.pinned.append(v)
        return id(v)

    def __call__(self, v: Any, seen: frozenset[int] = frozenset(), depth: int = 0) -> Any:
        if depth > 8:  # deep inside a library's objects (a kernel registry): by identity
            return ("deep", type(v).__qualname__, self.ident(v))
        if v is None or isinstance(v, (bool, int, float, str, bytes, complex)):
            return (type(v).__name__, v)
        if isinstance(v, (torch.dtype, torch.device, torch.layout, torch.memory_format)):
            return (type(v).__name__, str(v))
        if isinstance(v, enum.Enum):
            return ("enum", type(v).__qualname__, self.ident(type(v)), v.name)
        if isinstance(v, torch.Tensor):
            return _tensor_key(v)
        deeper = seen | {id(v)}
        if id(v) in seen:
            return ("cycle", self.ident(v))
        if isinstance(v, (tuple, list)):
            return (type(v).__name__, tuple(self(x, deeper, depth + 1) for x in v))
        if isinstance(v, (set, frozenset)):
            return (type(v).__name__, tuple(sorted(repr(self(x, deeper, depth + 1)) for x in v)))
        if isinstance(v, dict):
            return (type(v).__name__, tuple((repr(self(k, deeper, depth + 1)),
                                             self(x, deeper, depth + 1)) for k, x in v.items()))
        if isinstance(v, types.FunctionType):  # its code, defaults and closure's values
            return ("function", v.__qualname__, self.ident(v.__code__),
                    self(v.__defaults__, deeper, depth + 1),
                    self(v.__kwdefaults__, deeper, depth + 1),
                    tuple(self(_contents(c), deeper, depth + 1) for c in v.__closure__ or ()))
        if isinstance(v, types.MethodType):
            return ("method", self(v.__func__, deeper, depth + 1), self.ident(v.__self__))
        if isinstance(v, type):
            return ("type", v.__qualname__, self.ident(v))
        if isinstance(v, types.ModuleType):
            return ("python module", v.__name__)
        if isinstance(v, nn.Module):  # held outside _modules (a wrapped function): no state
            if v._parameters or v._buffers or v._modules:
                raise _Unkeyed("a module with state outside _modules")
            return ("module", self(type(v), deeper), self(type(v).forward, deeper, depth + 1),
                    self.attributes(v, deeper, depth + 1))
        state = getattr(v, "__dict__", None)
        if state is None or getattr(type(v), "__slots__", None):
            return ("object", type(v).__qualname__, self.ident(v))
        return ("object", self(type(v), deeper),
                tuple((k, self(x, deeper, depth + 1)) for k, x in sorted(state.items())))

    def attributes(self, mod: nn.Module, seen: frozenset[int] = frozenset(),
                   depth: int = 0) -> tuple:
        """A module's own attributes: everything in its ``__dict__`` but its parameters,
        buffers, submodules and (empty) hooks."""
        return tuple((k, self(x, seen, depth)) for k, x in sorted(vars(mod).items())
                     if k not in ("_parameters", "_buffers", "_modules", *_HOOKS))


_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
          "_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks",
          "_load_state_dict_post_hooks", "_forward_hooks_with_kwargs",
          "_forward_pre_hooks_with_kwargs", "_forward_hooks_always_called")


def _global_hooks() -> bool:
    m = torch.nn.modules.module
    return any(getattr(m, name, None) for name in (
        "_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
        "_global_backward_pre_hooks", "_global_module_registration_hooks",
        "_global_parameter_registration_hooks", "_global_buffer_registration_hooks"))


def capture_key(model: nn.Module, example_inputs: Any, loss_fn: Any, units: Any,
                opaque: Any) -> tuple[tuple, list[Any]] | None:
    """The cache key of a capture call and the objects it names by identity, or None when
    the call is not to be cached."""
    if _global_hooks():
        return None
    keyer = _Keyer()
    try:
        modules = []
        for name, mod in model.named_modules(remove_duplicate=False):
            if any(vars(mod).get(h) for h in _HOOKS):
                return None
            modules.append((name, keyer(type(mod)), keyer(type(mod).forward), mod.training,
                            keyer.attributes(mod)))
        first: dict[int, str] = {}
        params = tuple(
            (name, tuple(p.shape), str(p.dtype), str(p.device), keyer(type(p)),
             p.requires_grad, first.setdefault(id(p), name))
            for name, p in model.named_parameters(remove_duplicate=False))
        buffers = tuple((name, first.setdefault(id(b), name), _tensor_key(b))
                        for name, b in model.named_buffers(remove_duplicate=False))
        key = (tuple(modules), params, buffers, _batch_key(example_inputs), keyer(loss_fn),
               keyer(units), keyer(opaque), str(torch.get_default_dtype()))
    except _Unkeyed:
        return None
    return key, keyer.pinned


def _rebound(stored: Any, model: nn.Module, example_inputs: Any, loss_fn: Any) -> Any:
    """A fork of ``stored`` bound to ``model`` and its normalized example batch."""
    from rpcompile.capture.batch import normalize_batch
    from rpcompile.capture.dropout import dropout_seed

    captured = stored.fork()
    captured.model = model
    captured.loss_fn = loss_fn
    captured.example_batch = normalize_batch(model, example_inputs, loss_fn)
    captured.trainable = {n: p.requires_grad
                          for n, p in model.named_parameters(remove_duplicate=False)}
    captured.constants = {k: v.clone() for k, v in stored.constants.items()}
    captured.dropout_seed = dropout_seed() if stored.random_ops else 0
    return captured


def _differences(hit: Any, fresh: Any) -> list[str]:
    """Where a cache hit differs from a fresh capture of the same model."""
    out = []
    a, b = list(hit.graph_module.graph.nodes), list(fresh.graph_module.graph.nodes)
    if len(a) != len(b):
        out.append(f"{len(a)} nodes vs {len(b)}")
    def seen(n):  # what a pass reads of a node
        return (n.op, n.name, str(n.target), repr(n.args), repr(n.kwargs),
                repr(n.meta.get("val")), repr(n.meta.get("nn_module_stack")),
                {k: repr(v) for k, v in n.meta.items() if k.startswith("rp_")})

    for x, y in zip(a, b, strict=False):
        left, right = seen(x), seen(y)
        if left != right:
            out.append(f"node {x.name}: {left} vs {right}")
            break
    for f in dataclasses.fields(hit):
        if f.name in ("graph_module", "report", "model", "opaque_entries"):
            continue
        u, v = getattr(hit, f.name), getattr(fresh, f.name)
        if isinstance(u, dict) and u and isinstance(next(iter(u.values())), torch.Tensor):
            same = u.keys() == v.keys() and all(torch.equal(u[k], v[k]) for k in u)
        else:
            same = u == v
        if not same:
            out.append(f"{f.name}: {u!r} vs {v!r}")
    if dataclasses.replace(hit.report, seconds=0) != dataclasses.replace(fresh.report, seconds=0):
        out.append(f"report: {hit.report} vs {fresh.report}")
    return out


def cached(capture):
    """``capture`` (rpcompile.capture.core.capture's signature) with the suite's cache."""
    if _MODE == "0":
        return capture

    def capture_or_reuse(model, example_inputs=None, *, loss_fn=None, units=None, opaque=None,
                         **kw):
        keyed = None if kw or example_inputs is None else capture_key(
            model, example_inputs, loss_fn, units, opaque)
        key = keyed and keyed[0]
        if keyed is not None and key in _STORE:
            _STORE.move_to_end(key)
            hit = _rebound(_STORE[key][0], model, example_inputs, loss_fn)
            if _MODE == "check":
                fresh = capture(model, example_inputs, loss_fn=loss_fn, units=units, opaque=opaque)
                if diff := _differences(hit, fresh):
                    raise AssertionError("the suite's capture cache gave another graph than a "
                                         "fresh capture: " + "; ".join(diff[:5]))
            return hit
        with warnings.catch_warnings(record=True) as warned:
            warnings.simplefilter("always")
            captured = capture(model, example_inputs, loss_fn=loss_fn, units=units,
                               opaque=opaque, **kw)
        for w in warned:  # a hit would not warn again: a capture that warns is not kept
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, source=w.source)
        if keyed is not None and not warned and not captured.opaque_entries \
                and not captured.quantized:
            stored = captured.fork()
            stored.model = None
            _STORE[key] = stored, keyed[1]
            if len(_STORE) > _LIMIT:
                _STORE.popitem(last=False)
        return captured

    return capture_or_reuse
