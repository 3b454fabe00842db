"""Shared fixtures: tiny random-weight checkpoints, the bundled SmolLM2, paged greedy decoding.

Fixtures (all CPU, fp32 unless said otherwise):

    tiny_tokenizer       session  byte-level BPE tokenizer (vocab <= TINY_VOCAB) with a
                                  ChatML chat template; bos <|im_start|>, eos <|im_end|>
    tiny_llama_dir       session  Path of a Hugging Face folder: 2-layer GQA Llama with
                                  random weights (config.json, model.safetensors, tokenizer)
    tiny_llama           session  radixrt LoadedModel of tiny_llama_dir
    tiny_tools_dir       session  tiny_llama_dir's weights with a Qwen 2.5-like chat template that
                                  renders tools and teaches <tool_call>{json}</tool_call> (TOOLS_TEMPLATE)
    tiny_llama_hf        session  the same weights as a transformers LlamaForCausalLM
    make_tiny_hf_model   function factory: (**LlamaConfig/Qwen2Config/MistralConfig/Qwen3Config
                                  kwargs, architecture="llama"|"qwen2"|"mistral"|"qwen3", seed=0) ->
                                  transformers model with random weights, biases included
    smollm2              session  LoadedModel of the bundled SmolLM2-135M-Instruct (float32); the
                                  first run converts the GGUF into the real cache folder
                                  ($RADIXRT_CACHE_DIR or ~/.cache/radixrt), later runs reuse it.
                                  Loading takes seconds, so tests share it: Runtime(smollm2, ...)
                                  runs over these weights with its own KV pool
    smollm2_hf           session  transformers model read from the same GGUF file
    make_runner          function factory: (model, num_pages, page_size=1, backend="torch")
                                  -> (ModelRunner, PagePool) over a fresh KV pool
    paged_greedy         function callable: (runner, pool, prompts, max_new_tokens) -> token
                                  lists; all prompts prefilled in one batch, then decoded
                                  together, slots allocated from the pool page by page
    hf_greedy            function callable: (hf_model, prompts, max_new_tokens, batched=False)
                                  -> token lists from transformers with its DynamicCache, one
                                  prompt at a time, or all in one left-padded batch
"""

from __future__ import annotations

import os

# Before torch loads its OpenMP runtime: idle OpenMP workers sleep instead of spinning. The
# suite runs on a shared 2-core machine, where spinning workers fight every other process for
# the cores: measured there under load, model steps on the main thread (transformers
# references, paged_greedy) ran 3-7x slower with the default policy.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import save_file

from radixrt.kernels.forward_batch import ForwardBatch
from radixrt.kernels.registry import create_backend
from radixrt.memory.kv_cache import KVCache
from radixrt.memory.page_pool import PagePool
from radixrt.model.llama import LlamaForCausalLM
from radixrt.model.loader import LoadedModel, load_model
from radixrt.model.runner import ModelRunner

TINY_VOCAB = 384
CHATML_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "A radix tree shares the key-value cache of common prompt prefixes between requests.",
    "Paged attention stores each token's keys and values in fixed-size pages of a pool.",
    "What is the age of John Doe? He is forty-two years old and lives in Springfield.",
    "Few-shot prompts repeat the same examples; only the final question differs.",
] * 20
_CONFIG_CLASSES = {
    "llama": transformers.LlamaConfig,
    "qwen2": transformers.Qwen2Config,
    "mistral": transformers.MistralConfig,
    "qwen3": transformers.Qwen3Config,
    "gemma2": transformers.Gemma2Config,
    "gemma3_text": transformers.Gemma3TextConfig,
    "phi3": transformers.Phi3Config,
}


def randomize_weights(model: torch.nn.Module, seed: int, std: float = 0.08) -> None:
    """Random weights everywhere, biases included (transformers initializes those to zero),
    norm weights around 1, so every parameter influences the logits."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            param.copy_(1.0 + 0.1 * noise if "norm" in name else std * noise)


@pytest.fixture(scope="session")
def tiny_tokenizer() -> transformers.PreTrainedTokenizerFast:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_VOCAB,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(_CORPUS, trainer)
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<|im_start|>", eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    tokenizer.chat_template = CHATML_TEMPLATE
    assert len(tokenizer) <= TINY_VOCAB
    return tokenizer


@pytest.fixture
def make_tiny_hf_model() -> Callable[..., transformers.PreTrainedModel]:
    def make(architecture: str = "llama", seed: int = 0, **overrides: object) -> transformers.PreTrainedModel:
        kwargs: dict[str, object] = dict(
            vocab_size=TINY_VOCAB,
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=64,
            max_position_embeddings=1024,
            rms_norm_eps=1e-5,
            bos_token_id=1,
            eos_token_id=2,
            tie_word_embeddings=False,
        )
        if architecture == "mistral":
            kwargs["sliding_window"] = None
        kwargs.update(overrides)
        config = _CONFIG_CLASSES[architecture](**kwargs)
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
        randomize_weights(model, seed)
        return model

    return make


@pytest.fixture(scope="session")
def tiny_llama_dir(
    tmp_path_factory: pytest.TempPathFactory, tiny_tokenizer: transformers.PreTrainedTokenizerFast
) -> Path:
    folder = tmp_path_factory.mktemp("tiny-llama")
    config = transformers.LlamaConfig(
        vocab_size=TINY_VOCAB,
        hidden_size=192,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=1024,
        bos_token_id=tiny_tokenizer.bos_token_id,
        eos_token_id=tiny_tokenizer.eos_token_id,
        tie_word_embeddings=True,
        architectures=["LlamaForCausalLM"],
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    randomize_weights(model, seed=0, std=0.15)
    config.save_pretrained(folder)
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    tiny_tokenizer.save_pretrained(folder)
    return folder


# Qwen 2.5's tool format in few words (the tiny model's context is 1024 tokens): tools as JSON lines in
# the system turn, calls as <tool_call>{"name", "arguments"}</tool_call>, results as <tool_response>.
TOOLS_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nTools:\n{%- for tool in tools %}{{ '\\n' + (tool | tojson) }}{%- endfor %}"
    "\nCall one as <tool_call>\n{\"name\": <name>, \"arguments\": <object>}\n</tool_call><|im_end|>\n{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant"
    "{%- if message.content %}{{ '\\n' + message.content }}{%- endif %}"
    "{%- for call in message.tool_calls %}\n<tool_call>\n{\"name\": \"{{ call.function.name }}\", "
    "\"arguments\": {{ call.function.arguments | tojson }}}\n</tool_call>{%- endfor %}<|im_end|>\n"
    "{%- elif message.role == 'tool' %}<|im_start|>user\n<tool_response id={{ message.tool_call_id }}>\n"
    "{{ message.content }}\n</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)


@pytest.fixture(scope="session")
def tiny_tools_dir(tmp_path_factory: pytest.TempPathFactory, tiny_llama_dir: Path) -> Path:
    import shutil

    folder = tmp_path_factory.mktemp("tiny-tools") / "model"
    shutil.copytree(tiny_llama_dir, folder)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    tokenizer.chat_template = TOOLS_TEMPLATE
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_llama(tiny_llama_dir: Path) -> LoadedModel:
    return load_model(tiny_llama_dir, dtype="float32")


@pytest.fixture(scope="session")
def tiny_llama_hf(tiny_llama_dir: Path) -> transformers.PreTrainedModel:
    return transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def smollm2() -> LoadedModel:
    return load_model(None, dtype="float32")


@pytest.fixture(scope="session")
def smollm2_hf(smollm2: LoadedModel) -> transformers.PreTrainedModel:
    # transformers' own reading of the GGUF file: the reference our direct reading must equal
    return transformers.AutoModelForCausalLM.from_pretrained(
        smollm2.path.parent, gguf_file=smollm2.path.name, dtype=torch.float32
    ).eval()


@pytest.fixture
def make_runner() -> Callable[..., tuple[ModelRunner, PagePool]]:
    def make(
        model: LlamaForCausalLM, num_pages: int, page_size: int = 1, backend: str = "torch"
    ) -> tuple[ModelRunner, PagePool]:
        config = model.config
        kv_cache = KVCache(config.kv_shape(model.dtype), num_pages * page_size, model.device)
        attention = create_backend(backend, kv_cache, config.num_heads, config.num_kv_heads, config.head_dim, page_size)
        return ModelRunner(model, kv_cache, attention), PagePool(num_pages, page_size)

    return make


def _paged_greedy(
    runner: ModelRunner, pool: PagePool, prompts: list[list[int]], max_new_tokens: int
) -> list[list[int]]:
    """Greedy tokens, all prompts batched: one prefill batch, then one decode batch per step.

    Each sequence's slots come from `pool` a page at a time as it grows, so
    slots interleave across sequences the way a real scheduler leaves them.
    """
    slots = [pool.alloc(len(p)) for p in prompts]
    logits = runner.forward(
        ForwardBatch.build(prompts, [0] * len(prompts), [s[: len(p)] for s, p in zip(slots, prompts)])
    )
    outputs = [[int(t)] for t in logits.argmax(-1)]
    for _ in range(max_new_tokens - 1):
        seq_lens = [len(p) + len(o) for p, o in zip(prompts, outputs)]
        for i, length in enumerate(seq_lens):
            if length > slots[i].numel():
                slots[i] = torch.cat([slots[i], pool.alloc(1)])
        batch = ForwardBatch.build(
            [[o[-1]] for o in outputs], [n - 1 for n in seq_lens], [s[:n] for s, n in zip(slots, seq_lens)]
        )
        for output, token in zip(outputs, runner.forward(batch).argmax(-1).tolist()):
            output.append(token)
    for s in slots:
        pool.free(s)
    return outputs


@pytest.fixture
def paged_greedy() -> Callable[[ModelRunner, PagePool, list[list[int]], int], list[list[int]]]:
    return _paged_greedy


def _hf_greedy(
    model: transformers.PreTrainedModel, prompts: list[list[int]], max_new_tokens: int, batched: bool = False
) -> list[list[int]]:
    """transformers' greedy tokens (never stopping at EOS), with its DynamicCache.

    Default: one prompt at a time, no padding: the plainest reference.
    batched=True: all prompts in one left-padded batch with an attention mask
    and explicit positions; many times faster for a real model on a CPU, where
    each step is bound by reading the weights.
    """
    if not batched:
        return [_hf_greedy_padded(model, [prompt], max_new_tokens)[0] for prompt in prompts]
    return _hf_greedy_padded(model, prompts, max_new_tokens)


def _hf_greedy_padded(
    model: transformers.PreTrainedModel, prompts: list[list[int]], max_new_tokens: int
) -> list[list[int]]:
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    tokens = torch.empty(len(prompts), 0, dtype=torch.int64)
    cache = None
    with torch.inference_mode():
        for _ in range(max_new_tokens):
            out = model(ids, attention_mask=mask, position_ids=positions, past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            ids = out.logits[:, -1].argmax(-1, keepdim=True)
            tokens = torch.cat([tokens, ids], dim=1)
            mask = torch.cat([mask, torch.ones_like(ids)], dim=1)
            positions = positions[:, -1:] + 1
    return tokens.tolist()


@pytest.fixture
def hf_greedy() -> Callable[..., list[list[int]]]:
    return _hf_greedy
