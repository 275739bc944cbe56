"""The model and tokenizer of ``rpcompile train``: a local folder (``AutoModelForCausalLM`` /
``AutoTokenizer``), a name in the local Hugging Face cache, or a shipped config (built with
random weights and a byte-level tokenizer, written to ``OUT/base/`` and loaded from there like
any folder); optionally its frozen base quantized by bitsandbytes, and LoRA adapters."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from rpcompile.errors import InvalidInput


def _torch_dtype(name: str, device: str) -> Any:
    import torch

    if name == "auto":
        return torch.bfloat16 if device == "cuda" else torch.float32
    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[name]


def _dtype_name(name: str, device: str) -> str:
    return {"auto": "bf16" if device == "cuda" else "fp32"}.get(name, name)


def _write_shipped(name: str, folder: Path, seed: int) -> Path:
    """Build a shipped config with seeded random weights, give it the byte-level tokenizer and
    save both as a checkpoint folder (the starting point of the demo)."""
    import torch

    from rpcompile.data import byte_tokenizer
    from rpcompile.workloads.models import build_model

    tokenizer = byte_tokenizer()
    torch.manual_seed(seed)
    model = build_model(name, device="cpu", dtype=torch.float32, lora=False)
    if model.config.vocab_size < len(tokenizer):
        model.resize_token_embeddings(len(tokenizer), pad_to_multiple_of=8, mean_resizing=False)
    model.config.eos_token_id = model.config.pad_token_id = tokenizer.eos_token_id
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def model_folder(spec: str, out: Path) -> Path | None:
    """The folder ``--model spec`` is loaded from: ``spec`` itself, ``OUT/base`` for a shipped
    config (built there by a new run), or the snapshot in the local Hugging Face cache; None
    when there is none yet (a shipped config not built yet, an id not in the cache)."""
    from rpcompile.workloads.models import list_models

    path = Path(spec)
    if path.is_dir():
        return path
    if spec in list_models():
        return out / "base" if (out / "base" / "config.json").is_file() else None
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(spec, local_files_only=True))
    except Exception:  # not in the cache, or not a repository id: load_model says which
        return None


def load_model(spec: str, out: Path, dtype: Any, seed: int,
               quantize: str = "none") -> tuple[Any, Any, str]:
    """(model, tokenizer, folder it was loaded from). A shipped config is built into
    ``OUT/base`` once (a new run) and loaded from there (a resumed one). ``quantize``
    (``"nf4"``, ``"int8"``): the linears but the LM head loaded quantized by bitsandbytes
    (:func:`quantization_config`), on the host."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rpcompile.workloads.models import list_models

    path = Path(spec)
    if not path.is_dir() and spec in list_models():
        if (out / "base" / "config.json").is_file():
            path = out / "base"
        else:
            path = _write_shipped(spec, out / "base", seed)
            print(f"train: built {spec} with random weights (seed {seed}) into {path}/",
                  file=sys.stderr)
    local = path.is_dir()
    source = str(path) if local else spec
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=True)
        quantized = {} if quantize == "none" else dict(
            quantization_config=quantization_config(quantize, dtype), device_map={"": "cpu"})
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, local_files_only=True,
                                                     **quantized)
    except (OSError, ValueError) as err:
        if not local and "/" not in spec:
            raise InvalidInput(
                f"--model {spec!r} is not a folder, not a shipped config "
                f"({', '.join(list_models())}) and not in the local Hugging Face cache"
            ) from err
        raise InvalidInput(
            f"cannot load --model {spec}: {err}. A model folder needs config.json, the weights "
            "(safetensors) and a tokenizer (tokenizer.json / tokenizer_config.json); nothing is "
            "downloaded"
        ) from err
    if tokenizer.pad_token_id is None:
        if tokenizer.eos_token_id is None:
            raise InvalidInput(f"the tokenizer of {spec} has neither a pad nor an eos token")
        tokenizer.pad_token = tokenizer.eos_token
    if len(tokenizer) > model.config.vocab_size:
        raise InvalidInput(
            f"the tokenizer of {spec} has {len(tokenizer)} tokens, more than the model's "
            f"vocab_size {model.config.vocab_size}"
        )
    model.config.use_cache = False
    return model, tokenizer, source


def quantization_config(quantize: str, dtype: Any) -> Any:
    """The ``BitsAndBytesConfig`` of ``--quantize``: QLoRA's NF4 with double-quantized absmax,
    computing in ``dtype``; or LLM.int8() weights (``has_fp16_weights=False``). bitsandbytes
    keeps the LM head in full precision (transformers leaves it out)."""
    try:
        import bitsandbytes  # noqa: F401
    except ImportError as exc:
        raise ImportError(f"--quantize {quantize} needs bitsandbytes: "
                          "pip install 'rpcompile[qlora]'") from exc
    from transformers import BitsAndBytesConfig

    if quantize == "nf4":
        return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                  bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=dtype)
    if quantize == "int8":
        return BitsAndBytesConfig(load_in_8bit=True)
    raise InvalidInput(f"--quantize must be none, nf4 or int8, got {quantize!r}")


def add_lora(model: Any, rank: int, alpha: float | None, dropout: float, seed: int) -> Any:
    """PEFT LoRA adapters on every linear layer but the LM head (seeded init)."""
    import torch

    try:
        import peft
    except ImportError as exc:
        raise ImportError("--lora needs peft: pip install 'rpcompile[lora]'") from exc
    torch.manual_seed(seed)
    config = peft.LoraConfig(r=rank, lora_alpha=alpha or 2 * rank, lora_dropout=dropout,
                             target_modules="all-linear", task_type="CAUSAL_LM")
    return peft.get_peft_model(model, config)
