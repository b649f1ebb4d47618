"""Variable-length dummy data: sequence lengths drawn from a distribution, padded per batch or packed.

Padded against packed is a real throughput decision: padding each batch to its longest sequence wastes the padded
positions (the model computes them), packing fills every row but joins unrelated sequences. ``data.lengths`` draws
each sample's length (uniform, normal or a histogram the user gives, at most ``data.seq_len``); ``data.packing``
says what the trial trains on:

- ``pad``: one row per sequence, a collator pads each batch to its longest and masks the padding;
- ``pack`` (causal LM only): the same sequences, concatenated and cut into rows of ``seq_len`` tokens, no padding.

The throughput callback counts padded tokens (``tokens/s``) and, from the attention mask, real ones
(``real tokens/s``): the figure to compare between the two.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import datasets

    from hfscale.workload.spec import DataSpec

PAD_ID = 0
"""The id padding is written with (outside the drawn ids' [token_low, token_high) when token_low > 0)."""


def draw_lengths(spec: DataSpec) -> np.ndarray:
    """Each sample's length (``spec.num_samples`` of them, seeded by ``spec.seed``), in [lengths.min, seq_len]."""
    lengths = spec.lengths
    assert lengths is not None
    rng = np.random.default_rng(spec.seed + 1)  # apart from the token draw
    n, top = spec.num_samples, spec.seq_len
    if lengths.distribution == "uniform":
        drawn = rng.integers(lengths.min, top + 1, size=n)
    elif lengths.distribution == "normal":
        assert lengths.mean is not None and lengths.sd is not None
        drawn = np.rint(rng.normal(lengths.mean, lengths.sd, size=n))
    else:
        values = np.array(sorted(lengths.histogram), dtype=np.int64)
        weights = np.array([lengths.histogram[v] for v in sorted(lengths.histogram)], dtype=np.float64)
        drawn = rng.choice(values, size=n, p=weights / weights.sum())
    return np.clip(drawn, lengths.min, top).astype(np.int64)


def _sequences(spec: DataSpec) -> list[np.ndarray]:
    rng = np.random.default_rng(spec.seed)
    return [rng.integers(spec.token_low, spec.token_high, size=int(n), dtype=np.int64) for n in draw_lengths(spec)]


def packed_rows(spec: DataSpec) -> int:
    """Rows of ``seq_len`` tokens the packed data set holds (the tokens of every sequence, the last partial row
    dropped)."""
    return int(draw_lengths(spec).sum()) // spec.seq_len


def sequences_for_rows(spec: DataSpec, rows: int) -> int:
    """The fewest sequences (``num_samples``) whose packed data holds ``rows`` rows. A longer draw keeps the lengths
    of a shorter one (the same seeded stream), and a sequence is at most one row long, so packed rows grow one at a
    time with the sequences and the answer holds exactly ``rows``."""
    n = max(spec.num_samples, 1)
    while True:
        tokens = np.cumsum(draw_lengths(dataclasses.replace(spec, num_samples=n)))
        if tokens[-1] >= rows * spec.seq_len:
            return int(np.searchsorted(tokens, rows * spec.seq_len)) + 1
        n *= 2


def variable_length_data(spec: DataSpec, task: str) -> tuple[datasets.Dataset, Any]:
    """The data set and its collator: per-batch padding (``pad``), or packed rows and no collator (``pack``)."""
    import datasets

    sequences = _sequences(spec)
    if spec.packing == "pack":
        stream = np.concatenate(sequences)
        rows = stream[: packed_rows(spec) * spec.seq_len].reshape(-1, spec.seq_len)
        columns = {"input_ids": rows, "attention_mask": np.ones_like(rows), "labels": rows.copy()}
        return datasets.Dataset.from_dict(columns).with_format("torch"), None
    columns: dict[str, Any] = {"input_ids": [s.tolist() for s in sequences]}
    if task == "classification":
        labels = np.random.default_rng(spec.seed + 2).integers(0, spec.num_labels, size=len(sequences))
        columns["labels"] = labels.tolist()
    return datasets.Dataset.from_dict(columns), PadToLongest(causal_lm=task == "causal_lm")


class PadToLongest:
    """Pads each batch to its longest sequence with :data:`PAD_ID`, with the attention mask; causal LM labels are
    the ids with padding set to -100 (no loss on it), classification labels pass through."""

    def __init__(self, *, causal_lm: bool) -> None:
        self.causal_lm = causal_lm

    def __call__(self, batch: list[dict[str, Any]]) -> dict[str, Any]:
        import torch

        longest = max(len(item["input_ids"]) for item in batch)
        ids = torch.full((len(batch), longest), PAD_ID, dtype=torch.long)
        mask = torch.zeros((len(batch), longest), dtype=torch.long)
        for row, item in enumerate(batch):
            n = len(item["input_ids"])
            ids[row, :n] = torch.as_tensor(item["input_ids"], dtype=torch.long)
            mask[row, :n] = 1
        out = {"input_ids": ids, "attention_mask": mask}
        if self.causal_lm:
            out["labels"] = ids.masked_fill(mask == 0, -100)
        else:
            out["labels"] = torch.as_tensor([item["labels"] for item in batch], dtype=torch.long)
        return out


__all__ = ["PAD_ID", "PadToLongest", "draw_lengths", "packed_rows", "variable_length_data"]
