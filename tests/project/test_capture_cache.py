"""The suite's capture cache (tests/capture_cache.py): its key tells apart what export reads,
and a hit is the graph a fresh capture gives, bound to the new model."""

import torch

from rpcompile.capture.core import capture
from tests.capture_cache import _differences, cached, capture_key
from tests.tiny_models import hf_model


def _ids(rows=4, seq=12):
    return {"input_ids": torch.randint(0, 128, (rows, seq), generator=torch.Generator().manual_seed(3))}


def _key(model, batch=None, **kw):
    keyed = capture_key(model, batch or _ids(), kw.get("loss_fn"), kw.get("units"),
                        kw.get("opaque"))
    assert keyed is not None
    return keyed[0]


def test_the_key_ignores_weight_values_and_tells_apart_what_export_reads():
    base = _key(hf_model("qwen3", seed=0))
    assert _key(hf_model("qwen3", seed=5)) == base  # other weights: one graph
    frozen = hf_model("qwen3")
    frozen.model.embed_tokens.weight.requires_grad_(False)
    evaluated = hf_model("qwen3")
    evaluated.model.layers[1].eval()
    configured = hf_model("qwen3")
    configured.model.layers[0].self_attn.scaling = 0.5
    buffered = hf_model("qwen3")
    buffered.model.rotary_emb.inv_freq.mul_(2)
    others = [
        _key(hf_model("qwen3", layers=2)),
        _key(hf_model("llama")),
        _key(frozen),
        _key(evaluated),
        _key(configured),
        _key(buffered),
        _key(hf_model("qwen3").double()),
        _key(hf_model("qwen3"), _ids(rows=1)),  # a size of 1 specializes
        _key(hf_model("qwen3"), _ids(seq=9)),
        _key(hf_model("qwen3"), units=["model.layers"]),
    ]
    assert all(k != base for k in others)
    assert len(set(others)) == len(others)


def test_a_hit_is_a_fresh_capture_of_the_new_model():
    reuse = cached(capture)
    first, second = hf_model("qwen3", seed=0), hf_model("qwen3", seed=1)
    batch = _ids()
    stored = reuse(first, batch)
    hit = reuse(second, batch)
    assert hit.graph_module is not stored.graph_module
    assert hit.model is second and stored.model is first
    assert not _differences(hit, capture(second, batch))
    name = next(iter(hit.params))
    assert torch.equal(hit.value_of(name), second.get_parameter(hit.params[name]))
    assert not torch.equal(hit.value_of(name), stored.value_of(name))
    # and the check mode's comparison sees a graph that differs
    assert _differences(hit, capture(hf_model("qwen3", layers=2), batch))
