"""Every request field of SGLang's `/generate` (its `GenerateReqInput`, sglang 0.5.23), sorted into
what radixrt honours, what it accepts as a no-op, and what it refuses unless its value asks for
nothing. A field in none of them is a 400 (`check_generate_fields`); docs/server.md lists the
same table, and tests/test_sglang_frontend.py walks the installed sglang's fields against it.

The sampling parameters inside `sampling_params` are `radixrt.sampling.SamplingParams`' fields
(honoured or accepted as documented there) and `REFUSED_SAMPLING_FIELDS`.
"""

from __future__ import annotations

from typing import Any, Mapping

from radixrt.sampling.params import REFUSED_SAMPLING_FIELDS, SamplingParams

# Read and acted on by the /generate route.
GENERATE_HONOURED = frozenset({
    "rid", "text", "input_ids", "sampling_params", "stream", "return_logprob", "logprob_start_len",
    "top_logprobs_num", "token_ids_logprob", "return_text_in_logprobs", "cache_salt",
    "extra_key",  # SGLang's cache-isolation key: joins cache_salt in the namespace
})  # fmt: skip

# Accepted with any value; none of them changes what a request returns.
GENERATE_NOOPS: dict[str, str] = {
    "log_metrics": "radixrt counts every request in /metrics",
    "no_logs": "radixrt never logs request contents",
    "custom_labels": "metrics labels; /metrics has radixrt's own",
    "external_trace_header": "tracing headers; radixrt does not trace",
    "received_time": "SGLang-internal timestamp",
    "http_worker_ipc": "SGLang-internal",
    "routing_key": "a router's hint; one server routes nothing",
    "conversation_id": "a label for SGLang's logs",
    "priority": "SGLang ignores it too unless its server enables priority scheduling",
    "routed_experts_start_len": "only read with return_routed_experts, which is refused",
}

# Accepted only at the value that asks for nothing (None, or the default given); any other is a 400.
GENERATE_REFUSED: dict[str, tuple[Any, str]] = {
    "session_id": (None, "radixrt has no sessions (its radix cache reuses prefixes by itself)"),
    "session_params": (None, "radixrt has no sessions"),
    "input_embeds": (None, "radixrt takes text or token ids, not embeddings"),
    **{name: (None, "radixrt serves text-only models") for name in (
        "image_data", "video_data", "audio_data", "mm_hashes", "mm_content_hashes", "video_config", "modalities",
        "need_wait_for_mm_inputs", "num_items_assigned", "encoder_urls", "max_dynamic_patch", "min_dynamic_patch",
        "image_max_dynamic_patch", "video_max_dynamic_patch", "images_config", "mm_processor_kwargs",
    )},
    "use_audio_in_video": (False, "radixrt serves text-only models"),
    "watermark": (None, "radixrt does not watermark its output"),
    "return_sampling_mask": (False, "radixrt does not return sampling masks"),
    "sampling_logprobs_mode": (None, "radixrt's log-probs are of the masked, penalised distribution at "
                                     "temperature 1 (docs/sampling.md), in one mode"),
    "return_flat_raw_top_logprobs": (False, "radixrt returns top log-probs as SGLang's nested lists"),
    "return_flat_raw_output_top_logprobs": (False, "radixrt returns top log-probs as SGLang's nested lists"),
    "return_flat_raw_top_logprobs_b64": (False, "radixrt returns top log-probs as SGLang's nested lists"),
    "return_hidden_states": (False, "radixrt does not return hidden states"),
    "return_routed_experts": (False, "radixrt serves no mixture-of-experts model"),
    "return_indexer_topk": (False, "radixrt has no sparse-attention indexer"),
    "lora_path": (None, "radixrt has no LoRA adapters"),
    "lora_id": (None, "radixrt has no LoRA adapters"),
    "custom_logit_processor": (None, "radixrt runs no custom logit processor"),
    "positional_embed_overrides": (None, "radixrt does not override positions"),
    **{name: (None, "radixrt has no prefill/decode disaggregation") for name in (
        "bootstrap_host", "bootstrap_port", "bootstrap_room", "bootstrap_pair_key", "decode_tp_size",
        "disagg_prefill_dp_rank",
    )},
    "routed_dp_rank": (None, "radixrt has no data-parallel ranks (replicas are routed by the cache)"),
    "data_parallel_rank": (None, "radixrt has no data-parallel ranks (replicas are routed by the cache)"),
    "background": (False, "radixrt has no background requests"),
    "require_reasoning": (False, "radixrt has no reasoning parser"),
    "max_thinking_tokens": (None, "radixrt has no reasoning parser"),
    "return_bytes": (False, "radixrt returns text"),
    "return_entropy": (False, "radixrt does not return entropies"),
    "return_prompt_token_ids": (False, "radixrt does not echo prompt token ids (meta_info.prompt_tokens counts them)"),
    "multi_item_delimiter_indices": (None, "radixrt has no multi-item scoring"),
    "token_indices_to_pool": (None, "radixrt does not pool hidden states"),
    "kv_hints": (None, "radixrt takes no KV placement hints"),
}

SAMPLING_NOOPS: dict[str, str] = {
    "spaces_between_special_tokens": "radixrt decodes as Hugging Face's fast tokenizers do, which ignore it",
    "stream_interval": "radixrt streams every token as it is decoded",
}


def _asks_nothing(value: Any, default: Any) -> bool:
    if value is None or value == default:
        return True
    return isinstance(value, list) and all(_asks_nothing(v, default) for v in value)  # one per prompt


def check_generate_fields(body: Mapping[str, Any]) -> None:
    """ValueError naming the first field of a /generate body that radixrt cannot honour: one in
    no list, or a refused one whose value asks for something."""
    for name, value in body.items():
        if name in GENERATE_HONOURED or name in GENERATE_NOOPS:
            continue
        if name in GENERATE_REFUSED:
            default, why = GENERATE_REFUSED[name]
            if not _asks_nothing(value, default):
                raise ValueError(f"{name}: {why}; only {default!r} (or null) is accepted, got {value!r}")
            continue
        raise ValueError(f"{name}: not a field of SGLang's /generate (sglang 0.5.23's GenerateReqInput); "
                         "docs/server.md lists the accepted ones")


SAMPLING_HONOURED = frozenset(
    name for name in SamplingParams.__dataclass_fields__ if name not in SAMPLING_NOOPS
)
SAMPLING_REFUSED = REFUSED_SAMPLING_FIELDS
