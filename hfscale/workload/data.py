"""Dummy data: random token ids, so that every trial trains on the same data without a download or a tokenizer.

Speed and memory depend on the shapes, not on the token values, so uniform random ids stand in for a real corpus.
Every function is seeded and deterministic: the same arguments give the same data set on every machine (numpy's
PCG64 generator), which keeps loss curves comparable between trials.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

if TYPE_CHECKING:
    import datasets

    from hfscale.workload.spec import DataSpec

logger = logging.getLogger(__name__)

DataTask = Literal["classification", "causal_lm"]


def _check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{name}: expected an integer >= {minimum}, got {value!r}")


def _check_common(num_samples: Any, seq_len: Any, token_low: Any, token_high: Any, seed: Any) -> None:
    _check_int("num_samples", num_samples, 1)
    _check_int("seq_len", seq_len, 1)
    _check_int("token_low", token_low, 0)
    _check_int("token_high", token_high, 1)
    if token_high <= token_low:
        raise ValueError(
            f"token_high: expected a value above token_low={token_low} (ids are drawn from "
            f"[token_low, token_high)), got {token_high}"
        )
    _check_int("seed", seed, 0)


def _random_tokens(rng: np.random.Generator, num_samples: int, seq_len: int, low: int, high: int) -> np.ndarray:
    # One vectorised draw: 512 x 512 ids take about 2 ms.
    return rng.integers(low, high, size=(num_samples, seq_len), dtype=np.int64)


def _to_dataset(columns: dict[str, np.ndarray]) -> datasets.Dataset:
    import datasets

    # from_dict converts 2-D numpy arrays to Arrow list arrays in one go (no per-row Python objects).
    return datasets.Dataset.from_dict(columns).with_format("torch")


def make_classification_dataset(
    num_samples: int = 512,
    seq_len: int = 512,
    *,
    token_low: int = 100,
    token_high: int = 30000,
    num_labels: int = 2,
    seed: int = 0,
) -> datasets.Dataset:
    """Random sequences with random class labels, for ``AutoModelForSequenceClassification`` models.

    Columns (torch format): ``input_ids`` int64 ``[seq_len]`` drawn uniformly from ``[token_low, token_high)``,
    ``attention_mask`` int64 ones (no padding), ``labels`` int64 in ``[0, num_labels)``.

    Raises:
        ValueError: when an argument is out of range; the message names the argument.
    """
    _check_common(num_samples, seq_len, token_low, token_high, seed)
    _check_int("num_labels", num_labels, 1)
    rng = np.random.default_rng(seed)
    input_ids = _random_tokens(rng, num_samples, seq_len, token_low, token_high)
    labels = rng.integers(0, num_labels, size=num_samples, dtype=np.int64)
    return _to_dataset(
        {"input_ids": input_ids, "attention_mask": np.ones_like(input_ids), "labels": labels},
    )


def make_causal_lm_dataset(
    num_samples: int = 512,
    seq_len: int = 512,
    *,
    token_low: int = 100,
    token_high: int = 30000,
    seed: int = 0,
) -> datasets.Dataset:
    """Random sequences for causal language modelling: ``labels`` is a copy of ``input_ids`` (the model shifts).

    Columns (torch format): ``input_ids``, ``attention_mask`` (ones) and ``labels``, all int64 ``[seq_len]``.

    Raises:
        ValueError: when an argument is out of range; the message names the argument.
    """
    _check_common(num_samples, seq_len, token_low, token_high, seed)
    rng = np.random.default_rng(seed)
    input_ids = _random_tokens(rng, num_samples, seq_len, token_low, token_high)
    return _to_dataset(
        {"input_ids": input_ids, "attention_mask": np.ones_like(input_ids), "labels": input_ids.copy()},
    )


def make_dataset(spec: DataSpec, task: DataTask) -> datasets.Dataset:
    """The data set a trial's :class:`~hfscale.workload.spec.DataSpec` describes, for a model trained on ``task``.

    Raises:
        ValueError: for an unknown task, or a spec field out of range (named as ``data.FIELD``).
    """
    try:
        if task == "classification":
            return make_classification_dataset(
                spec.num_samples,
                spec.seq_len,
                token_low=spec.token_low,
                token_high=spec.token_high,
                num_labels=spec.num_labels,
                seed=spec.seed,
            )
        if task == "causal_lm":
            return make_causal_lm_dataset(
                spec.num_samples,
                spec.seq_len,
                token_low=spec.token_low,
                token_high=spec.token_high,
                seed=spec.seed,
            )
    except ValueError as exc:
        raise ValueError(f"data.{exc}") from None
    raise ValueError(f"task: expected one of 'classification', 'causal_lm', got {task!r}")


def make_training_data(spec: DataSpec, task: DataTask) -> tuple[datasets.Dataset, Any]:
    """The trial's data set and its collator: the user's ``data.factory`` where the recipe names one, else the dummy
    data of :func:`make_dataset` with no collator (the Trainer's default).

    Raises:
        ValueError: as :func:`make_dataset`, or :func:`hfscale.workload.factory.build_from_data_factory`.
    """
    if spec.factory is not None:
        from hfscale.workload.factory import build_from_data_factory

        return build_from_data_factory(spec.factory, spec.factory_kwargs)
    if spec.lengths is not None or spec.packing == "pack":
        from hfscale.workload.lengths import variable_length_data

        return variable_length_data(spec, task)
    return make_dataset(spec, task), None


__all__ = ["DataTask", "make_causal_lm_dataset", "make_classification_dataset", "make_dataset", "make_training_data"]
