"""`radixrt explain`: ask a running server why a prompt would (not) hit its cache.

The standard library's urllib only: the command line needs no HTTP package
beyond what the server itself depends on.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any


class ExplainError(Exception):
    """The server could not be reached or refused the request (the message says which)."""


def request_explanation(
    url: str, prompt: str, chat: bool = False, api_key: str | None = None, cache_salt: str | None = None,
    timeout_s: float = 60.0,
) -> dict[str, Any]:
    """POST /cache/explain on the server at `url` and return its report."""
    body: dict[str, Any] = {"messages": [{"role": "user", "content": prompt}]} if chat else {"text": prompt}
    if cache_salt is not None:
        body["cache_salt"] = cache_salt
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    endpoint = url.rstrip("/") + "/cache/explain"
    request = urllib.request.Request(endpoint, data=json.dumps(body).encode(), headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            report: dict[str, Any] = json.loads(response.read())
            return report
    except urllib.error.HTTPError as error:
        raise ExplainError(f"{endpoint}: HTTP {error.code}: {_error_message(error.read())}") from None
    except (urllib.error.URLError, OSError) as error:
        reason = getattr(error, "reason", error)
        raise ExplainError(f"{endpoint}: cannot reach the server ({reason}); is `radixrt serve` running?") from None


def _error_message(body: bytes) -> str:
    try:
        return str(json.loads(body)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return body.decode(errors="replace")[:300]


def format_report(report: dict[str, Any]) -> str:
    """The report as a few readable lines."""
    total, cached, at = report["prompt_tokens"], report["cached_tokens"], report["diverged_at"]
    lines = [f"prompt: {total} tokens, {cached} would come from the cache ({cached / total:.0%})"]
    if "replica" in report:
        lines.append(f"replica: {report['replica']}")
    if at is None:
        lines.append("the whole prompt is cached")
    else:
        lines.append(f"leaves the cache at token {at}, after: {report['context_text']!r}")
        lines.append(f"  this prompt goes on: {report['prompt_text']!r}")
        lines.append(f"  the cache goes on:   {report['cached_text']!r}" if report["cached_text"]
                     else "  the cache holds nothing past this point")
    return "\n".join(lines)
