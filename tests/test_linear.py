"""Prepacked projections give exactly F.linear's results, or are not used."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from radixrt.model import linear


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("rows", [1, 8, 33, 300])
def test_pack_matches_f_linear_exactly(dtype, with_bias, rows):
    generator = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 64, generator=generator).to(dtype)
    bias = torch.randn(96, generator=generator).to(dtype) if with_bias else None
    x = torch.randn(rows, 64, generator=generator).to(dtype)
    assert torch.equal(linear.pack(weight, bias)(x), F.linear(x, weight, bias))


def test_pack_keeps_leading_dimensions():
    weight = torch.randn(32, 16).to(torch.bfloat16)
    x = torch.randn(3, 5, 16).to(torch.bfloat16)
    out = linear.pack(weight)(x)
    assert out.shape == (3, 5, 32) and torch.equal(out, F.linear(x, weight))


def test_plain_reads_weights_loaded_later():
    weight = torch.zeros(4, 4)
    project = linear.plain(weight)
    weight.copy_(torch.eye(4))
    x = torch.randn(2, 4)
    assert torch.equal(project(x), x)
