"""A parameter's elements as the model computes with it: QLoRA's packed 4-bit weights at their dequantised shape,
ZeRO-3's placeholders at their full size, anything else as it is."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from hfscale.core.params import param_numel


def test_a_plain_parameter_counts_its_elements():
    assert param_numel(torch.nn.Linear(4, 3).weight) == 12


def test_a_zero3_placeholder_counts_its_full_size():
    placeholder = torch.nn.Parameter(torch.empty(0))
    placeholder.ds_numel = 64
    assert param_numel(placeholder) == 64


def test_a_packed_4bit_weight_counts_its_dequantised_shape():
    packed = torch.nn.Parameter(torch.empty(6, 1, dtype=torch.uint8), requires_grad=False)  # two weights a byte
    packed.quant_state = SimpleNamespace(shape=torch.Size([3, 4]))
    assert param_numel(packed) == 12
