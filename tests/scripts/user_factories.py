"""A user's own model and data as factories, in a module outside hfscale (tests/scenarios/test_factories.py names
them in a recipe as ``user_factories.py:build_model`` and ``user_factories.py:build_data``).

They reuse the classes of the example script beside this file (its folder is on ``sys.path`` when hfscale loads a
``file.py:function`` factory): a ``PreTrainedModel`` hfscale does not build, and variable-length data with a collator
that pads each batch.
"""

from __future__ import annotations

from hf_example import DataArguments, TinyClassifier, TinyConfig, collate, make_data


def build_model(hidden_size: int = 32, num_layers: int = 2) -> TinyClassifier:
    return TinyClassifier(TinyConfig(hidden_size=hidden_size, num_layers=num_layers))


def build_data(num_samples: int = 128, min_len: int = 8, max_len: int = 48) -> tuple:
    data = DataArguments(num_samples=num_samples, min_len=min_len, max_len=max_len)
    return make_data(data, vocab_size=TinyConfig().vocab_size), collate
