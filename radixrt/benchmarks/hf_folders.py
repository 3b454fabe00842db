"""A Hugging Face folder written from a GGUF model's dense weights, for tests and benchmarks of
folder loading and of quantizing at load (never committed: rebuilt from the bundled file).

The weights are the ones radixrt's dense GGUF load reads (gguf's reference dequantizer, q and k
rows in Hugging Face order), in float32, then cast to the folder's dtype; the config and the
tokenizer are transformers' reading of the same file. Tensors are saved under transformers'
names, tied embeddings without an `lm_head.weight`.
"""

from __future__ import annotations

from pathlib import Path

import torch

from radixrt.model.llama import checkpoint_projections
from radixrt.model.loader import LoadedModel, load_model

_PARAMETERS = {"qkv": "qkv_proj", "o": "o_proj", "gate_up": "gate_up_proj", "down": "down_proj"}


def state_dict(loaded: LoadedModel, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """A dense model's weights under transformers' names, in `dtype`, fused projections split."""
    model, config = loaded.model, loaded.config
    tensors: dict[str, torch.Tensor] = {"model.embed_tokens.weight": model.embed_tokens,
                                        "model.norm.weight": model.norm}
    if not config.tie_word_embeddings:
        tensors["lm_head.weight"] = model.lm_head
    for index, layer in enumerate(model.decoder_layers()):
        prefix = f"model.layers.{index}."
        tensors[prefix + "input_layernorm.weight"] = layer.input_norm
        tensors[prefix + "post_attention_layernorm.weight"] = layer.post_attention_norm
        for fused, parts in checkpoint_projections(config, index).items():
            weight, start = getattr(layer, _PARAMETERS[fused]), 0
            for name, rows in parts:
                tensors[name] = weight[start : start + rows]
                start += rows
    return {name: tensor.detach().to(dtype).contiguous() for name, tensor in tensors.items()}


def write_hf_folder(target: Path, source: Path | None = None, dtype: torch.dtype = torch.bfloat16) -> Path:
    """`target` (created): config.json, model.safetensors in `dtype` and the tokenizer of the GGUF
    file `source` (None: the bundled SmolLM2-135M-Instruct), a Llama-family model."""
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    loaded = load_model(source, device="cpu", dtype="float32", weights="dense")
    target.mkdir(parents=True, exist_ok=True)
    loaded.hf_config.save_pretrained(target)
    save_file(state_dict(loaded, dtype), str(target / "model.safetensors"), metadata={"format": "pt"})
    AutoTokenizer.from_pretrained(loaded.path.parent, gguf_file=loaded.path.name).save_pretrained(target)
    return target
