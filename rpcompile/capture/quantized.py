"""Quantized frozen weights: bitsandbytes 4-bit (NF4, FP4) and 8-bit linears, captured as what
they are.

A ``bnb.nn.Linear4bit`` becomes a frozen packed parameter (two 4-bit codes a byte), its
quantization state (lifted constants: the 16-entry code table and the per-block absmax, itself
8-bit with a second-level scale, code table and offset when double-quantized), one
``rpcompile::dequantize_4bit`` node that rebuilds the weight in the compute dtype, and an
ordinary ``linear``. A ``bnb.nn.Linear8bitLt`` becomes its int8 weight, its per-row absmax and
one ``rpcompile::dequantize_int8`` node. Both compute what bitsandbytes computes when it trains:
dequantize, then the matmul in the compute dtype. The cost pass sees the packed bytes (host
memory, uploads) and the dequantized weight (the device working set) apart.

Sections, in reading order:
  1. PackedWeight: one quantized weight's tensors and sizes (what the host store keeps)
  2. The dequantize ops and their torch implementation (the reference the kernels match)
  3. Capture: which modules are quantized, what is refused, the forward used while exporting
  4. Stage graphs as a worker runs them: each weight rebuilt once per job, not per call

Anything else quantized (GPTQ, AWQ and other methods, a quantized trainable weight, full
fine-tuning of a quantized model) is refused with :class:`RefusedModel` before export.
"""

from __future__ import annotations

import contextlib
import math
import threading
import weakref
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from rpcompile.capture.types import RefusedModel
from rpcompile.errors import InvalidInput

__all__ = [
    "FORMATS",
    "DequantizeSite",
    "PackedWeight",
    "dequantize_4bit_reference",
    "dequantize_int8_reference",
    "dequantize_sites",
    "packed_weights",
    "state_4bit",
    "without_dequantize",
]

FORMATS = ("nf4", "fp4", "int8")
# A packed weight is kept as one record of whole 4-byte words (its fp32 state first), so every
# record of a flat host buffer starts where its fp32 tensors can be viewed.
PACKED_ALIGN = 4

_SUPPORTED = (
    "rpcompile trains a frozen bitsandbytes base (Linear4bit NF4/FP4, with or without double "
    "quantization, or Linear8bitLt int8 with has_fp16_weights=False) under trainable LoRA "
    "adapters (PEFT)"
)


# ---------------------------------------------------------------------------------------------
# 1. PackedWeight
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PackedWeight:
    """One frozen quantized weight as the host keeps it and a worker uploads it.

    ``packed``: the packed codes (uint8 for 4-bit, two codes a byte, the first in the high
    nibble; int8 for 8-bit), a parameter of the user's model. ``state``: the quantization
    state, in the order the dequantize op takes it (name, tensor): ``code`` (16 fp32 values),
    ``absmax`` (fp32, or uint8 when double-quantized), then ``absmax_code`` (256 fp32),
    ``absmax_scale`` (fp32) and ``absmax_offset`` (fp32 scalar) when double-quantized; for
    int8 only ``row_absmax`` (fp32, one per output row). ``shape`` is the weight's logical
    (out_features, in_features); ``blocksize`` the weights per absmax (4-bit);
    ``absmax_blocksize`` the absmax values per second-level scale (0 when not nested).
    """

    format: str
    shape: tuple[int, int]
    packed: torch.Tensor
    state: tuple[tuple[str, torch.Tensor], ...]
    blocksize: int = 0
    absmax_blocksize: int = 0

    @property
    def numel(self) -> int:
        """Elements of the dequantized weight."""
        return math.prod(self.shape)

    @property
    def packed_bytes(self) -> int:
        """Bytes of the packed codes and the quantization state, in whole 4-byte words
        (:data:`PACKED_ALIGN`): what the host holds and a job uploads for this weight."""
        return packed_record_bytes([self.packed, *(t for _, t in self.state)])

    def dequantized_bytes(self, dtype: torch.dtype) -> int:
        return self.numel * torch.empty((), dtype=dtype).element_size()


def packed_record_bytes(tensors) -> int:
    """Bytes of one packed weight's record: its tensors' bytes rounded up to PACKED_ALIGN."""
    return -(-sum(t.nbytes for t in tensors) // PACKED_ALIGN) * PACKED_ALIGN


# ---------------------------------------------------------------------------------------------
# 2. The dequantize ops
# ---------------------------------------------------------------------------------------------
# Exactness (checked against bitsandbytes in tests/capture/test_quantized.py): a double-quantized
# absmax is absmax_code[a] * absmax_scale[i // absmax_blocksize], then + absmax_offset, two
# fp32 roundings as bitsandbytes' dequantize_blockwise followed by its separate add; weight
# element j is code[nibble j] * absmax[j // blocksize] in fp32, rounded once to the compute
# dtype. int8 is fp32(weight) * (row_absmax * fp32(1/127)), rounded once.


def _absmax(absmax, absmax_code, absmax_scale, absmax_offset, absmax_blocksize):
    if absmax_code is None:
        return absmax
    index = torch.arange(absmax.numel(), device=absmax.device) // absmax_blocksize
    return absmax_code[absmax.long()] * absmax_scale[index] + absmax_offset


def dequantize_4bit_reference(
    packed: torch.Tensor,
    code: torch.Tensor,
    absmax: torch.Tensor,
    absmax_code: torch.Tensor | None,
    absmax_scale: torch.Tensor | None,
    absmax_offset: torch.Tensor | None,
    blocksize: int,
    absmax_blocksize: int,
    shape: list[int],
    dtype: torch.dtype,
) -> torch.Tensor:
    """The 4-bit weight rebuilt in ``dtype`` with torch ops (the kernels' reference)."""
    n = math.prod(shape)
    scale = _absmax(absmax, absmax_code, absmax_scale, absmax_offset, absmax_blocksize)
    codes = torch.stack([packed.reshape(-1) >> 4, packed.reshape(-1) & 0xF], dim=1)
    values = code[codes.reshape(-1)[:n].long()]
    block = torch.arange(n, device=packed.device) // blocksize
    return (values * scale[block]).to(dtype).reshape(shape)


def dequantize_int8_reference(weight: torch.Tensor, row_absmax: torch.Tensor,
                              dtype: torch.dtype) -> torch.Tensor:
    """The int8 weight rebuilt in ``dtype`` with torch ops (the kernels' reference)."""
    scale = row_absmax.float() * torch.tensor(1.0 / 127.0, dtype=torch.float32)
    return (weight.float() * scale[:, None]).to(dtype)


@torch.library.custom_op("rpcompile::dequantize_4bit", mutates_args=())
def _dequantize_4bit_op(
    packed: torch.Tensor,
    code: torch.Tensor,
    absmax: torch.Tensor,
    absmax_code: torch.Tensor | None,
    absmax_scale: torch.Tensor | None,
    absmax_offset: torch.Tensor | None,
    blocksize: int,
    absmax_blocksize: int,
    shape: list[int],
    dtype: torch.dtype,
) -> torch.Tensor:
    return dequantize_4bit_reference(packed, code, absmax, absmax_code, absmax_scale,
                                     absmax_offset, blocksize, absmax_blocksize, shape, dtype)


@_dequantize_4bit_op.register_fake
def _(packed, code, absmax, absmax_code, absmax_scale, absmax_offset, blocksize,
      absmax_blocksize, shape, dtype):
    return packed.new_empty(shape, dtype=dtype)


@torch.library.custom_op("rpcompile::dequantize_int8", mutates_args=())
def _dequantize_int8_op(weight: torch.Tensor, row_absmax: torch.Tensor,
                        dtype: torch.dtype) -> torch.Tensor:
    return dequantize_int8_reference(weight, row_absmax, dtype)


@_dequantize_int8_op.register_fake
def _(weight, row_absmax, dtype):
    return weight.new_empty(weight.shape, dtype=dtype)


DEQUANTIZE_OPS = (torch.ops.rpcompile.dequantize_4bit.default,
                  torch.ops.rpcompile.dequantize_int8.default)


# ---------------------------------------------------------------------------------------------
# 3. Capture
# ---------------------------------------------------------------------------------------------


def _bnb():
    try:
        import bitsandbytes
    except ImportError:  # only reached for a model that holds bitsandbytes modules
        return None
    return bitsandbytes


def _is_bnb(module: nn.Module) -> bool:
    return type(module).__module__.split(".")[0] == "bitsandbytes"


def quantized_linears(model: nn.Module) -> dict[str, nn.Module]:
    """The model's bitsandbytes linears, by module name, after :func:`check_quantized`."""
    bnb = _bnb() if any(_is_bnb(m) for m in model.modules()) else None
    if bnb is None:
        return {}
    kinds = (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt)
    return {name: m for name, m in model.named_modules() if isinstance(m, kinds)}


_OTHER_LIBRARIES = ("auto_gptq", "gptqmodel", "awq", "hqq", "optimum", "quanto", "torchao",
                    "compressed_tensors", "eetq", "aqlm", "vptq", "fbgemm_gpu", "higgs",
                    "spqr", "bitnet", "fp_quant")


def check_quantized(model: nn.Module) -> dict[str, nn.Module]:
    """Refuse what rpcompile cannot train exactly; return the supported quantized linears.

    Refused, with :class:`RefusedModel`: a ``quantization_config`` of another method than
    bitsandbytes, modules of other quantization libraries, bitsandbytes modules other than
    Linear4bit / Linear8bitLt, a trainable quantized weight (an int8 linear with
    ``has_fp16_weights=True``; a 4-bit weight cannot require grad), a weight repacked for CPU
    inference, a 4-bit weight stored in another dtype than uint8, any other non-floating
    parameter, and a quantized model with no trainable PEFT adapter (full fine-tuning).
    """
    config = getattr(getattr(model, "config", None), "quantization_config", None)
    method = (config.get("quant_method") if isinstance(config, dict)
              else getattr(config, "quant_method", None))
    method = getattr(method, "value", method)
    if method is not None and str(method).lower() != "bitsandbytes":
        raise RefusedModel(
            f"{type(model).__name__} is quantized with {method}, which rpcompile cannot "
            f"train: {_SUPPORTED}. Load the bf16 checkpoint with transformers' "
            "BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type='nf4') instead"
        )
    for name, module in model.named_modules():
        root = type(module).__module__.split(".")[0]
        if root in _OTHER_LIBRARIES and any(True for _ in module.parameters(recurse=False)) | \
                any(True for _ in module.buffers(recurse=False)):
            raise RefusedModel(
                f"{name} is a {type(module).__name__} from {root}, a quantization rpcompile "
                f"cannot train: {_SUPPORTED}"
            )
    linears = quantized_linears(model)
    for name, module in model.named_modules():
        if _is_bnb(module) and name not in linears and any(
                True for _ in module.parameters(recurse=False)):
            raise RefusedModel(
                f"{name} is a bitsandbytes {type(module).__name__}, which rpcompile cannot "
                f"train: {_SUPPORTED}; keep that module unquantized (e.g. "
                "BitsAndBytesConfig(llm_int8_skip_modules=[...]))"
            )
    for name, module in linears.items():
        _check_linear(name, module)
    owners = {id(p) for m in linears.values() for p in m.parameters(recurse=False)}
    for name, p in model.named_parameters():
        if id(p) not in owners and not (p.dtype.is_floating_point or p.dtype.is_complex):
            raise RefusedModel(
                f"parameter {name} has dtype {p.dtype}: a quantized weight rpcompile does not "
                f"know how to dequantize. {_SUPPORTED}"
            )
    if linears and not _has_trainable_adapter(model):
        raise RefusedModel(
            f"{type(model).__name__} has a quantized base ({len(linears)} bitsandbytes linears) "
            "but no trainable LoRA adapter: full fine-tuning of a quantized model is not "
            f"supported ({_SUPPORTED}). Add adapters with peft.get_peft_model(model, "
            "LoraConfig(...)), or fine-tune the bf16 model in full"
        )
    return linears


def _check_linear(name: str, module: nn.Module) -> None:
    bnb = _bnb()
    weight = module.weight
    if isinstance(module, bnb.nn.Linear4bit):
        state = getattr(weight, "quant_state", None)
        if state is None:
            raise RefusedModel(
                f"{name} is a Linear4bit whose weight is not quantized yet (no quant_state): "
                "load the model with BitsAndBytesConfig(load_in_4bit=True) so bitsandbytes "
                "quantizes it"
            )
        if getattr(state, "packing_format_for_cpu", False):
            raise RefusedModel(
                f"{name}'s 4-bit weight was repacked for CPU inference (bitsandbytes does so "
                "when an eval-mode model runs without gradients on an AVX512-BF16 CPU): reload "
                "the model and capture it in train mode"
            )
        if weight.dtype != torch.uint8:
            raise RefusedModel(
                f"{name}'s 4-bit weight is stored as {weight.dtype} "
                "(bnb_4bit_quant_storage); rpcompile keeps packed weights as uint8: load with "
                "the default bnb_4bit_quant_storage=torch.uint8"
            )
        if state.quant_type not in ("nf4", "fp4") or len(state.shape) != 2:
            raise RefusedModel(
                f"{name}: 4-bit type {state.quant_type!r} with weight shape "
                f"{tuple(state.shape)}; {_SUPPORTED}"
            )
        return
    if module.state.has_fp16_weights or weight.requires_grad:
        raise RefusedModel(
            f"{name} is a Linear8bitLt with has_fp16_weights=True: its weight is trainable and "
            f"quantized on every call, which rpcompile does not train ({_SUPPORTED}); load "
            "with BitsAndBytesConfig(load_in_8bit=True) (has_fp16_weights=False) and train "
            "adapters"
        )
    if _int8_scale(module) is None or weight.dtype != torch.int8:
        raise RefusedModel(
            f"{name} is a Linear8bitLt whose weight is not quantized yet (no SCB): load the "
            "model with BitsAndBytesConfig(load_in_8bit=True) so bitsandbytes quantizes it"
        )


def _has_trainable_adapter(model: nn.Module) -> bool:
    try:
        from peft.tuners.tuners_utils import BaseTunerLayer
    except ImportError:
        return False
    return any(isinstance(m, BaseTunerLayer) and any(p.requires_grad for p in m.parameters())
               for m in model.modules())


def _int8_scale(module: nn.Module) -> torch.Tensor | None:
    """The per-row absmax of an int8 linear: on the weight before its first call, in the
    module's matmul state after (bitsandbytes moves it there)."""
    scale = getattr(module.weight, "SCB", None)
    return scale if scale is not None else module.state.SCB


def state_4bit(quant_state) -> tuple[tuple[str, torch.Tensor], ...]:
    """A bitsandbytes 4-bit ``QuantState`` as the dequantize op takes it: (name, tensor) in the
    op's order (see :class:`PackedWeight`)."""
    code = quant_state.code
    if quant_state.quant_type == "fp4":
        # FP4 code 8 is the sign bit over a zero: bitsandbytes' compiled dequantize gives -0.0
        # there, while its table (and its torch fallback) holds +0.0. The compiled kernel is the
        # one bitsandbytes runs, so the graph decodes -0.0 too.
        code = code.clone()
        code[8] = -0.0
    out = [("code", code), ("absmax", quant_state.absmax)]
    if quant_state.nested:
        out += [("absmax_code", quant_state.state2.code),
                ("absmax_scale", quant_state.state2.absmax), ("absmax_offset", quant_state.offset)]
    return tuple(out)


def _compute_dtype(module: nn.Module, x: torch.Tensor) -> torch.dtype:
    """The dtype bitsandbytes' Linear4bit computes in: its compute_dtype once set; else that
    of the input when fp32 or bf16 (the first call sets it so); else the configured one."""
    if module.compute_type_is_set or x.dtype not in (torch.float32, torch.bfloat16):
        return module.compute_dtype or x.dtype
    return x.dtype


def _forward_of(module: nn.Module):
    """The forward used while exporting. Its quantization state is read now: during export
    the module's parameters are fake tensors, without bitsandbytes' attributes."""
    if isinstance(module, _bnb().nn.Linear4bit):
        quant = module.weight.quant_state
        state = dict(state_4bit(quant))
        sizes = (quant.blocksize, quant.state2.blocksize if quant.nested else 0,
                 list(quant.shape))

        def forward(x: torch.Tensor) -> torch.Tensor:
            dtype = _compute_dtype(module, x)
            weight = torch.ops.rpcompile.dequantize_4bit(
                module.weight, state["code"], state["absmax"], state.get("absmax_code"),
                state.get("absmax_scale"), state.get("absmax_offset"), *sizes, dtype)
            bias = None if module.bias is None else module.bias.to(dtype)
            return F.linear(x.to(dtype), weight, bias).to(x.dtype)

        return forward
    scale = _int8_scale(module)

    def forward_int8(x: torch.Tensor) -> torch.Tensor:
        weight = torch.ops.rpcompile.dequantize_int8(module.weight, scale, x.dtype)
        bias = None if module.bias is None else module.bias.to(x.dtype)
        return F.linear(x, weight, bias)

    return forward_int8


@contextlib.contextmanager
def quantized_patched(linears: dict[str, nn.Module]) -> Iterator[None]:
    """Route each quantized linear's forward through the dequantize ops while exporting (the
    module itself is unchanged afterwards)."""
    saved = []
    try:
        for module in linears.values():
            forward = _forward_of(module)

            def call(x, *args, _module=module, _forward=forward, **kwargs):
                if args or kwargs:
                    raise RefusedModel(
                        f"{type(_module).__name__} was called with arguments beyond its input; "
                        "rpcompile captures quantized linears called as linear(x)"
                    )
                return _forward(x)

            saved.append((module, module.__dict__.get("forward")))
            module.__dict__["forward"] = call
        yield
    finally:
        for module, previous in reversed(saved):
            if previous is None:
                module.__dict__.pop("forward", None)
            else:
                module.__dict__["forward"] = previous


def packed_weights(gm: torch.fx.GraphModule, params: dict[str, str],
                   value_of) -> dict[str, PackedWeight]:
    """Every quantized weight of a captured graph, by parameter name, read off its dequantize
    nodes (``value_of(placeholder)`` gives a placeholder's tensor)."""
    out: dict[str, PackedWeight] = {}
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in DEQUANTIZE_OPS:
            continue
        fqn = params[node.args[0].name]
        if node.target is DEQUANTIZE_OPS[0]:
            names = ("code", "absmax", "absmax_code", "absmax_scale", "absmax_offset")
            state = tuple((n, value_of(a.name)) for n, a in zip(names, node.args[1:6])
                          if a is not None)
            blocksize, absmax_blocksize, shape = node.args[6], node.args[7], node.args[8]
            kind = "nf4" if float(state[0][1][1]) < 0 else "fp4"  # NF4's codes are sorted
        else:
            state = (("row_absmax", value_of(node.args[1].name)),)
            blocksize = absmax_blocksize = 0
            shape, kind = list(node.meta["val"].shape), "int8"
        out[fqn] = PackedWeight(format=kind, shape=(int(shape[0]), int(shape[1])),
                                packed=value_of(node.args[0].name), state=state,
                                blocksize=int(blocksize), absmax_blocksize=int(absmax_blocksize))
    return out


# ---------------------------------------------------------------------------------------------
# 4. Stage graphs as a worker runs them
# ---------------------------------------------------------------------------------------------
# A job uploads its stage's packed weights once and runs the stage's graph once per microbatch
# (twice for a recomputed backward). The worker rebuilds each weight once per job, with the
# fused kernel (rpcompile.runtime.kernels.dequantize_packed), and runs a copy of the graph
# whose dequantize nodes are gone: each linear reads the packed weight's placeholder, which
# the job binds to the rebuilt weight. The kernel is bit-identical to the op, so both graphs
# compute the same values.

_STATE_ARGS = {
    DEQUANTIZE_OPS[0]: ("code", "absmax", "absmax_code", "absmax_scale", "absmax_offset"),
    DEQUANTIZE_OPS[1]: ("row_absmax",),
}


@dataclass(frozen=True)
class DequantizeSite:
    """One quantized weight of a stage graph: the placeholder of its packed codes, the dtype
    the graph rebuilds it in, and the placeholders of its state by
    :attr:`PackedWeight.state` name."""

    packed: str
    dtype: torch.dtype
    state: tuple[tuple[str, str], ...]


_SITES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_SITES_LOCK = threading.Lock()


def dequantize_sites(gm: torch.fx.GraphModule) -> tuple[DequantizeSite, ...]:
    """The quantized weights ``gm`` rebuilds, in graph order (cached per graph)."""
    with _SITES_LOCK:
        cached = _SITES.get(gm)
    if cached is not None:
        return cached
    sites: dict[str, DequantizeSite] = {}
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in DEQUANTIZE_OPS:
            continue
        packed = node.args[0]
        if packed.op != "placeholder":
            raise InvalidInput(f"{node.name} rebuilds {packed.name}, which is not a graph input")
        names = _STATE_ARGS[node.target]
        state = tuple((part, arg.name) for part, arg in zip(names, node.args[1:])
                      if arg is not None)
        site = DequantizeSite(packed.name, node.meta["val"].dtype, state)
        if sites.setdefault(packed.name, site) != site:
            raise InvalidInput(f"{packed.name} is rebuilt twice in one stage graph, as "
                             f"{sites[packed.name].dtype} and {site.dtype}")
    result = tuple(sites.values())
    with _SITES_LOCK:
        _SITES[gm] = result
    return result


def without_dequantize(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """``gm`` itself when it rebuilds no quantized weight; else a copy in which what read
    each rebuilt weight reads its packed placeholder, to be bound to the weight the job
    rebuilt (:func:`dequantize_sites`). Every placeholder stays, so the copy takes the same
    arguments."""
    if not dequantize_sites(gm):
        return gm
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in DEQUANTIZE_OPS:
            env[node] = env[node.args[0]]
        else:
            env[node] = graph.node_copy(node, lambda a: env[a])
    return torch.fx.GraphModule(gm, graph, class_name=type(gm).__name__)
