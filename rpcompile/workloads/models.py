"""Model configs that ship with rpcompile: the RoundPipe paper's five workloads and a tiny Qwen3
for the demo. Models are built from their public configs (no hub access), on the ``meta``
device by default, so a 235B model can be planned and simulated without allocating weights."""

from __future__ import annotations

import json
from functools import cache
from importlib import resources

import torch
from torch import nn

from rpcompile.errors import InvalidInput

__all__ = ["build_model", "list_models", "model_config"]

_CLASSES = {
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
}


@cache
def _configs() -> dict[str, dict]:
    folder = resources.files("rpcompile").joinpath("workloads/configs")
    return {
        f.name.removesuffix(".json"): json.loads(f.read_text())
        for f in folder.iterdir() if f.name.endswith(".json")
    }


def list_models() -> list[str]:
    return sorted(_configs())


def model_config(name: str) -> dict:
    table = _configs()
    if name not in table:
        raise InvalidInput(f"unknown model {name!r}; known: {', '.join(sorted(table))}")
    return dict(table[name])


def build_model(
    name: str,
    device: str | torch.device = "meta",
    layers: int | None = None,
    dtype: torch.dtype = torch.bfloat16,
    lora: bool | int | None = None,
) -> nn.Module:
    """Build a shipped model from its config.

    ``layers`` overrides the depth (for quick tests). ``lora``: wrap with PEFT LoRA adapters
    on every linear layer when the config asks for it (``rpcompile_lora``) or when True; an
    int is the rank (alpha twice it; 0: none).
    """
    import transformers

    cfg = model_config(name)
    lora_cfg = cfg.pop("rpcompile_lora", None)
    kind = cfg.pop("model_type")
    config_cls, model_cls = (getattr(transformers, c) for c in _CLASSES[kind])
    if layers is not None:
        cfg["num_hidden_layers"] = layers
        if "layer_types" in cfg:
            cfg["layer_types"] = cfg["layer_types"][:layers]
    # sdpa where the architecture supports it (GPT-OSS does not: its attention has sinks).
    attn = "eager" if kind == "gpt_oss" else "sdpa"
    config = config_cls(**cfg, use_cache=False, attn_implementation=attn)
    with torch.device(device):
        model = model_cls(config).to(dtype)
    if not isinstance(lora, bool) and isinstance(lora, int) and lora > 0:
        lora_cfg = {"r": lora, "alpha": 2 * lora}
    if lora or (lora is None and lora_cfg):
        lora_cfg = lora_cfg or {"r": 16, "alpha": 32}
        try:
            import peft
        except ImportError as exc:
            raise ImportError(
                f"{name} is trained with LoRA adapters; install peft (pip install "
                "'rpcompile[lora]') or pass lora=False"
            ) from exc
        # Every nn.Linear but the LM head. Fused expert weights are 3-D parameters, not
        # linear modules: they stay frozen, as in the paper's LoRA setting.
        targets = sorted({
            n.rsplit(".", 1)[-1] for n, m in model.named_modules()
            if isinstance(m, nn.Linear) and not n.endswith("lm_head")
        })
        model = peft.get_peft_model(model, peft.LoraConfig(
            r=lora_cfg["r"], lora_alpha=lora_cfg["alpha"], target_modules=targets,
            lora_dropout=0.0,
        ))
    return model
