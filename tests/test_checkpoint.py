"""Mapped safetensors reading: every tensor equals what `safetensors` itself reads."""

from __future__ import annotations

import json

import torch
from safetensors.torch import load_file, save_file

from radixrt.model.checkpoint import SafetensorsWeights, checkpoint_weights


def test_mapped_tensors_equal_safetensors(tmp_path):
    generator = torch.Generator().manual_seed(0)
    tensors = {
        "f32": torch.randn(3, 5, generator=generator),
        "bf16": torch.randn(7, generator=generator).bfloat16(),
        "f16": torch.randn(2, 2, generator=generator).half(),
        "i64": torch.arange(5),
        "u8": torch.arange(9, dtype=torch.uint8).view(3, 3),
        "bool": torch.tensor([True, False, True]),
        "scalar": torch.tensor(2.5),
        "empty": torch.empty(0, 4),
        "fp8": torch.randn(4, generator=generator).to(torch.float8_e4m3fn),  # read through safetensors itself
    }
    save_file(tensors, str(tmp_path / "model.safetensors"))
    expected = load_file(tmp_path / "model.safetensors")
    weights = checkpoint_weights(tmp_path)
    assert isinstance(weights, SafetensorsWeights)
    assert set(weights) == set(expected) and len(weights) == len(expected)
    for name, tensor in expected.items():
        got = weights[name]
        assert got.dtype == tensor.dtype and got.shape == tensor.shape, name
        assert torch.equal(got.reshape(-1).view(torch.uint8), tensor.reshape(-1).view(torch.uint8)), name


def test_writing_a_mapped_tensor_leaves_the_file_alone(tmp_path):
    save_file({"w": torch.ones(4)}, str(tmp_path / "model.safetensors"))
    weights = checkpoint_weights(tmp_path)
    weights["w"].zero_()
    assert torch.equal(load_file(tmp_path / "model.safetensors")["w"], torch.ones(4))


def test_sharded_folder(tmp_path):
    save_file({"a": torch.ones(2)}, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file({"b": torch.zeros(3)}, str(tmp_path / "model-00002-of-00002.safetensors"))
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    weights = checkpoint_weights(tmp_path)
    assert torch.equal(weights["a"], torch.ones(2)) and torch.equal(weights["b"], torch.zeros(3))
