"""hfscale.estimate.shape: the meta-device build counts what the real model holds."""

from __future__ import annotations

from helpers.models import TINY_BERT

from hfscale.estimate import describe_model, model_shape_from_module
from hfscale.workload.spec import ModelSpec


def test_meta_build_counts_the_real_model(tiny_bert):
    shape = describe_model(ModelSpec(type="bert", config=TINY_BERT))
    real = model_shape_from_module(tiny_bert)
    assert shape.num_params == sum(p.numel() for p in tiny_bert.parameters())
    assert shape.params == real.params
    assert shape.largest_layer_params == tiny_bert.bert.embeddings.word_embeddings.weight.numel()
    assert shape.num_blocks == 2 and shape.block_params == sum(
        p.numel() for p in tiny_bert.bert.encoder.layer[0].parameters()
    )


def test_gpt2_tied_head_is_counted_once(tiny_gpt2):
    shape = model_shape_from_module(tiny_gpt2)
    assert shape.num_params == sum(p.numel() for p in tiny_gpt2.parameters())
    wte = next(p for p in shape.params if p.name.endswith("wte.weight"))
    assert wte.in_embedding and wte.in_matmul  # tied with the LM head: autocast casts it, bnb keeps it 32-bit


def test_importing_the_estimate_loads_neither_torch_nor_transformers():
    """A result row carries a MemoryEstimate: reading rows must not pay for torch."""
    import subprocess
    import sys

    code = "import sys, hfscale.estimate; print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
