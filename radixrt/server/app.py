"""`create_app(runtime, settings)`: the FastAPI app of `radixrt serve`.

Handlers only translate: a body becomes `Runtime.async_generate` arguments
(tokenizing and the chat template run in a worker thread inside it), and its
result becomes an OpenAI or SGLang response. Nothing computes on the event
loop, so `/health` and other streams never wait behind one request.

A client that goes away aborts its requests: a stream's task is cancelled by
the server when the connection drops, a plain request's by a watcher of the
connection, and cancelling the awaiting call aborts in the engine within one
step.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import re
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable, Literal, TypeVar

import orjson
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from pydantic import BaseModel

import radixrt
from radixrt.runtime import Runtime
from radixrt.sampling.params import CONSTRAINT_FIELDS
from radixrt.server import openai_api, tool_parsers, tools
from radixrt.server.constraints import Constraint
from radixrt.server.dashboard import DASHBOARD_HTML
from radixrt.server.metrics import ServerMetrics
from radixrt.server.sglang_fields import check_generate_fields
from radixrt.server.protocol import (
    AbortRequest,
    ChatCompletionRequest,
    CompletionRequest,
    ExplainRequest,
    GenerateRequest,
)
from radixrt.tree import ALL_NAMESPACES

logger = logging.getLogger("radixrt.server")
T = TypeVar("T")


@dataclass(frozen=True)
class ServerSettings:
    """What `radixrt serve` adds to the runtime's own configuration.

    api_keys: when non-empty, every endpoint but /health needs `Authorization: Bearer KEY`.
    cache_isolation: "per-key" gives each API key its own cache namespace (on top of any
        cache_salt), so no tenant can see another's cached prefixes through hit counts or TTFT.
    max_queued_requests: requests held beyond those the engine runs at once; more is a 503.
    served_model_name: the model id clients send and /v1/models lists (default: the model's name).
    tool_call_parser: the syntax of the model's tool calls (radixrt.server.tools.TOOL_CALL_PARSERS);
        None reads it from the chat template.
    """

    api_keys: frozenset[str] = frozenset()
    cache_isolation: Literal["none", "per-key"] = "none"
    max_queued_requests: int = 1024
    served_model_name: str | None = None
    tool_call_parser: str | None = None


class APIError(Exception):
    """An error with its HTTP status, in OpenAI's body."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


_FIELD_FIRST = re.compile(r"^([A-Za-z_][\w.\[\]]*)(?::| must| is )")


def _bad_request(error: ValueError, default_param: str | None = None, constraint: Constraint | None = None) -> APIError:
    """A 400 naming the field: validation messages start with it ("temperature must be ...").

    An error about the output constraint names the field the client sent: the runtime's message
    names `json_schema`, which a client that sent `response_format` never wrote.
    """
    message = str(error)
    named = _FIELD_FIRST.match(message)
    param = named.group(1) if named else default_param
    if param == "prompt" and default_param is not None:
        param = default_param  # the runtime's word for whichever field carried the prompt
    if constraint is not None and param == constraint.field and constraint.source != constraint.field:
        return APIError(400, f"{constraint.source}: {message}", param=constraint.source)
    return APIError(400, message, param=param)


@dataclass
class _State:
    runtime: Runtime
    settings: ServerSettings
    model_name: str
    template_tools: tools.TemplateTools  # what the chat template does with tools (probed on first use)
    metrics: ServerMetrics = field(default_factory=ServerMetrics)
    active_requests: int = 0

    def finished(self, meta: dict[str, Any]) -> None:
        """Count a finished request in the metrics, and log it at debug level."""
        self.metrics.observe_finished(meta)
        logger.debug(
            "%s: %s, prompt %d tokens (%d cached), output %d, ttft %.3f s, e2e %.3f s",
            meta["id"], meta["finish_reason"]["type"], meta["prompt_tokens"], meta["cached_tokens"],
            meta["completion_tokens"], meta["ttft"], meta["e2e_latency"],
        )


class _ORJSONResponse(JSONResponse):
    def render(self, content: Any) -> bytes:
        return orjson.dumps(content)


def create_app(runtime: Runtime, settings: ServerSettings | None = None) -> FastAPI:
    """An app serving `runtime`; the caller owns the runtime (and shuts it down)."""
    settings = settings or ServerSettings()
    state = _State(runtime, settings, settings.served_model_name or runtime.model_name,
                   tools.TemplateTools(runtime.tokenizer, settings.tool_call_parser))
    app = FastAPI(title="radixrt", version=radixrt.__version__, default_response_class=_ORJSONResponse)
    max_active = runtime.config.max_running_requests + settings.max_queued_requests

    @app.exception_handler(APIError)
    async def _api_error(request: Request, error: APIError) -> Response:
        return _ORJSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, error: RequestValidationError) -> Response:
        first = error.errors()[0] if error.errors() else {}
        if first.get("type") == "json_invalid":
            message = f"the body is not valid JSON: {first.get('ctx', {}).get('error', 'parse error')}"
            return _ORJSONResponse(APIError(400, message).body(), status_code=400)
        location = [str(part) for part in first.get("loc", ()) if part != "body"]
        param = ".".join(location) or None
        message = f"{param}: {first.get('msg', 'invalid request')}" if param else str(first.get("msg", error))
        return _ORJSONResponse(APIError(400, message, param=param).body(), status_code=400)

    async def tenant(request: Request) -> str | None:
        """The caller's API key (None without keys); 401 when keys are set and it is missing or wrong."""
        if not settings.api_keys:
            return None
        header = request.headers.get("authorization", "")
        key = header[7:] if header.lower().startswith("bearer ") else ""
        if not any(hmac.compare_digest(key.encode(), known.encode()) for known in settings.api_keys):
            raise APIError(401, "a valid API key is required: send 'Authorization: Bearer KEY'",
                           type_="authentication_error", code="invalid_api_key")
        return key

    def cache_salt(key: str | None, salt: str | None) -> str | None:
        if settings.cache_isolation != "per-key" or key is None:
            return salt
        tenant_id = hashlib.sha256(key.encode()).hexdigest()[:16]
        return f"tenant:{tenant_id}:{salt or ''}"

    def check_model(model: str | None) -> None:
        if model is not None and model != state.model_name:
            raise APIError(404, f"model {model!r} does not exist; this server serves {state.model_name!r}",
                           param="model", code="model_not_found")

    def log_unknown(body: BaseModel, route: str) -> None:
        extra = sorted(body.model_extra or {})
        if extra:
            logger.debug("%s: ignoring unknown field(s) %s", route, ", ".join(extra))

    def admit(num_requests: int) -> Callable[[], None]:
        """Take places for `num_requests` requests (503 when full); returns their release."""
        if state.active_requests + num_requests > max_active:
            raise APIError(503, f"the server is at its limit of {max_active} requests "
                                f"({settings.max_queued_requests} queued); retry later",
                           type_="server_overloaded", code="overloaded")
        state.active_requests += num_requests
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                state.active_requests -= num_requests

        return release

    async def run_plain(num_requests: int, default_param: str, request: Request,
                        constraint: Constraint | None = None, **kwargs: Any) -> list[dict]:
        """A whole `async_generate` call; a disconnect cancels it, which aborts its requests."""
        release = admit(num_requests)
        try:
            result = await _cancel_on_disconnect(request, runtime.async_generate(**kwargs))
        except ValueError as error:
            raise _bad_request(error, default_param, constraint) from None
        except asyncio.CancelledError:
            state.metrics.observe_aborted(num_requests)
            raise
        finally:
            release()
        assert isinstance(result, (dict, list)), "a call without stream returns results"
        results = result if isinstance(result, list) else [result]
        for item in results:
            state.finished(item["meta_info"])
        return results

    async def run_stream(
        num_requests: int, default_param: str, events: Callable[[AsyncIterator[dict]], AsyncIterator[bytes]],
        constraint: Constraint | None = None, **kwargs: Any,
    ) -> Response:
        """A streamed call. However the response ends (done, error, client gone, even before its
        first byte), unfinished requests are aborted and their places released."""
        release = admit(num_requests)
        try:
            chunks = await runtime.async_generate(stream=True, **kwargs)
        except ValueError as error:
            release()
            raise _bad_request(error, default_param, constraint) from None
        except BaseException:
            release()
            raise
        assert not isinstance(chunks, (dict, list))
        rids = _as_list(kwargs["rid"])
        progress = _StreamProgress()

        def close() -> None:
            release()
            if progress.finished == num_requests:
                return  # every request ended on its own: nothing to abort
            # The client left, or the stream failed: stop what still runs.
            state.metrics.observe_aborted(num_requests - progress.finished, progress.unfinished_tokens())
            for rid in rids:
                try:
                    runtime.abort(rid)  # aborts the unfinished requests of this id (or group)
                except RuntimeError:  # the runtime is shutting down: nothing left to free
                    return

        return _EventStream(events(_counting(chunks, progress)), close)

    # --- OpenAI ---------------------------------------------------------------------
    @app.get("/v1/models")
    async def models(key: str | None = Depends(tenant)) -> dict[str, Any]:
        return {"object": "list", "data": [{
            "id": state.model_name, "object": "model", "created": 0, "owned_by": "radixrt",
            "max_model_len": runtime.inputs.limits.context_len,
        }]}

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request,
                               key: str | None = Depends(tenant)) -> Response:
        check_model(body.model)
        try:
            messages = body.chat_messages()
            params = openai_api.chat_sampling_params(body)
            constraint = openai_api.body_constraint(body)
            plan = openai_api.tool_plan(body)
        except ValueError as error:
            raise _bad_request(error, "messages") from None
        options: dict[str, Any] = {
            "messages": messages, "sampling_params": params, "cache_salt": cache_salt(key, body.cache_salt),
            "rid": body.rid or openai_api.new_id("chatcmpl"), "constraint": constraint,
        }
        syntax = None
        if plan is not None:  # the template renders the tools: the prompt is made here, not in generate
            try:
                syntax = await asyncio.to_thread(state.template_tools.syntax, plan.choice)
                if state.template_tools.call_tag_is_special(syntax):
                    params["skip_special_tokens"] = False  # the parser must see <tool_call>
                if plan.constrained:
                    options["constraint"] = openai_api.constrain_to_calls(plan, syntax, params, constraint)
                options["input_ids"] = await asyncio.to_thread(
                    runtime.inputs.encode_messages, messages, body.tools
                )
            except ValueError as error:
                raise _bad_request(error, "tools") from None
            del options["messages"]
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            writer = openai_api.ChunkWriter("chat", state.model_name, include_usage)
            calls = None if plan is None or syntax is None else (syntax, plan.parallel)
            chat_logprobs = None
            if body.logprobs:
                def chat_logprobs(index: int, result: dict[str, Any]) -> dict[str, Any] | None:
                    return openai_api.chat_logprobs(result, runtime.tokenizer)
            return await run_stream(
                body.n, "messages",
                lambda chunks: _openai_stream(state, chunks, writer, body.n, body.n, calls,
                                              logprobs_of=chat_logprobs),
                **options,
            )
        results = await run_plain(body.n, "messages", request, **options)
        return _ORJSONResponse(
            openai_api.chat_response(body, results, state.model_name, runtime.tokenizer, plan, syntax)
        )

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request, key: str | None = Depends(tenant)) -> Response:
        check_model(body.model)
        try:
            params = openai_api.completion_sampling_params(body)
            constraint = openai_api.body_constraint(body)
        except ValueError as error:
            raise _bad_request(error, "best_of") from None
        prompts = _completion_prompts(body.prompt)
        echo_logprobs = body.echo and body.logprobs is not None
        if echo_logprobs and isinstance(prompts[0], str):  # the prompt's tokens are needed to show its log-probs
            try:
                prompts = await asyncio.to_thread(lambda: [runtime.inputs.encode_text(p) for p in prompts])
            except ValueError as error:
                raise _bad_request(error, "prompt") from None
        is_text = isinstance(prompts[0], str)
        single = isinstance(body.prompt, str) or _is_token_list(body.prompt)
        rid = body.rid or openai_api.new_id("cmpl")
        options: dict[str, Any] = {
            "sampling_params": params, "cache_salt": cache_salt(key, body.cache_salt),
            "rid": rid if single else [f"{rid}-{i}" for i in range(len(prompts))], "constraint": constraint,
        }
        if echo_logprobs:
            options["logprob_start_len"] = 0
        options["prompt" if is_text else "input_ids"] = prompts[0] if single else prompts
        num_requests = body.n * len(prompts)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            writer = openai_api.ChunkWriter("completion", state.model_name, include_usage)
            echoed = None
            if body.echo:  # each choice's first delta is its prompt
                echo_texts = await asyncio.to_thread(_prompt_texts, runtime.tokenizer, prompts)
                echoed = [echo_texts[i // body.n] for i in range(num_requests)]
            completion_logprobs = None
            if body.logprobs is not None:
                def completion_logprobs(index: int, result: dict[str, Any]) -> dict[str, Any] | None:
                    logprobs = openai_api.completion_logprobs(result, runtime.tokenizer)
                    if echo_logprobs and logprobs is not None:
                        return openai_api.echo_logprobs(result, prompts[index // body.n], runtime.tokenizer, logprobs)
                    return logprobs
            return await run_stream(
                num_requests, "prompt",
                lambda chunks: _openai_stream(state, chunks, writer, num_requests, body.n, echo=echoed,
                                              logprobs_of=completion_logprobs),
                **options,
            )
        results = await run_plain(num_requests, "prompt", request, **options)
        texts = _prompt_texts(runtime.tokenizer, prompts) if body.echo else None
        ids = prompts if echo_logprobs else None
        return _ORJSONResponse(
            openai_api.completion_response(body, results, state.model_name, runtime.tokenizer, texts, ids)
        )

    # --- SGLang native ------------------------------------------------------------------
    @app.post("/generate")
    async def native_generate(body: GenerateRequest, request: Request, key: str | None = Depends(tenant)) -> Response:
        try:
            check_generate_fields(body.model_extra or {})
        except ValueError as error:
            raise _bad_request(error) from None
        if (body.text is None) == (body.input_ids is None):
            raise APIError(400, "give exactly one of text or input_ids", param="text")
        prompts: list[Any] = body.text if isinstance(body.text, list) else list(body.input_ids or [])
        many = isinstance(body.text, list) or bool(prompts) and isinstance(prompts[0], list)
        num_prompts = len(prompts) if many else 1
        params: Any = body.sampling_params
        if isinstance(params, list):
            params = [_sglang_sampling(p) for p in params]
            if not many and len(params) == 1:
                params = params[0]  # SGLang takes a one-item list for one prompt
        else:
            params = _sglang_sampling(params or {})
        rid: str | list[str] | None = body.rid
        if rid is None:
            rid = [openai_api.new_id("gen") for _ in range(num_prompts)] if many else openai_api.new_id("gen")
        salt = body.cache_salt if body.extra_key is None else f"{body.extra_key}:{body.cache_salt or ''}"
        options: dict[str, Any] = {
            "sampling_params": params, "cache_salt": cache_salt(key, salt), "rid": rid,
            "return_logprob": body.return_logprob, "logprob_start_len": body.logprob_start_len,
            "top_logprobs_num": body.top_logprobs_num, "token_ids_logprob": body.token_ids_logprob,
            "return_text_in_logprobs": body.return_text_in_logprobs,
        }
        if body.text is not None:
            options["prompt"] = body.text
        else:
            options["input_ids"] = body.input_ids
        samples = [p.get("n", 1) if isinstance(p, dict) else 1 for p in (params if isinstance(params, list) else
                                                                         [params] * num_prompts)]  # fmt: skip
        num_requests = sum(n if isinstance(n, int) and n > 0 else 1 for n in samples)
        if body.stream:
            return await run_stream(num_requests, "text", lambda chunks: _native_stream(state, chunks), **options)
        results = await run_plain(num_requests, "text", request, **options)
        return _ORJSONResponse(results if many or len(results) > 1 else results[0])

    @app.get("/health")
    async def health() -> Response:
        if not runtime.is_alive():
            return _ORJSONResponse(APIError(503, "the engine has stopped", type_="server_error").body(), 503)
        return _ORJSONResponse({})

    @app.get("/get_model_info")
    @app.get("/model_info")
    async def model_info(key: str | None = Depends(tenant)) -> dict[str, Any]:
        limits = runtime.inputs.limits
        return {"model_path": runtime.model_name, "tokenizer_path": runtime.model_name, "is_generation": True,
                "served_model_name": state.model_name, "context_length": limits.context_len,
                "vocab_size": limits.vocab_size}

    @app.get("/get_server_info")
    @app.get("/server_info")
    async def server_info(key: str | None = Depends(tenant)) -> dict[str, Any]:
        stats = await asyncio.to_thread(runtime.cache_stats)
        return {
            "version": radixrt.__version__,
            "model_path": runtime.model_name,
            "served_model_name": state.model_name,
            "runtime_config": runtime.config.as_dict(),
            "deterministic": runtime.deterministic,  # what deterministic="auto" chose
            "kernel_isa": getattr(runtime, "kernel_isa", None),  # the CPU kernels' instruction set
            "weight_formats": getattr(runtime, "weight_formats", None),  # parameters by the format they run in
            "cache_isolation": settings.cache_isolation,
            "max_queued_requests": settings.max_queued_requests,
            "api_key_required": bool(settings.api_keys),
            "cache_stats": stats,
            **({"replicas": await asyncio.to_thread(runtime.replica_stats)} if hasattr(runtime, "replica_stats") else {}),
        }

    @app.post("/flush_cache")
    async def flush_cache(key: str | None = Depends(tenant)) -> dict[str, Any]:
        try:
            await asyncio.to_thread(runtime.flush_cache)
        except RuntimeError as error:
            raise APIError(409, str(error), code="busy") from None
        return {"message": "cache flushed"}

    @app.post("/abort_request")
    async def abort_request(body: AbortRequest, key: str | None = Depends(tenant)) -> dict[str, Any]:
        runtime.abort(body.rid)
        return {"rid": body.rid}

    @app.post("/cache/explain")
    async def explain_cache(body: ExplainRequest, key: str | None = Depends(tenant)) -> dict[str, Any]:
        log_unknown(body, "/cache/explain")
        try:
            return await asyncio.to_thread(
                runtime.explain_cache, body.text, input_ids=body.input_ids, messages=body.messages,
                cache_salt=cache_salt(key, body.cache_salt),
            )
        except ValueError as error:
            given = "input_ids" if body.input_ids is not None else "messages" if body.messages is not None else "text"
            raise _bad_request(error, given) from None

    @app.get("/cache/tree.svg")
    async def cache_tree_svg(max_nodes: int = 200, key: str | None = Depends(tenant)) -> Response:
        # With per-key isolation a tenant sees its own namespace only, never the others' prefixes.
        namespace = cache_salt(key, None) if settings.cache_isolation == "per-key" else ALL_NAMESPACES
        try:
            svg = await asyncio.to_thread(runtime.cache_tree_svg, max_nodes, cache_salt=namespace)
        except ValueError as error:
            raise _bad_request(error, "max_nodes") from None
        return Response(svg, media_type="image/svg+xml")

    @app.get("/dashboard")
    async def dashboard() -> Response:
        return HTMLResponse(DASHBOARD_HTML)

    @app.get("/metrics")
    async def metrics(key: str | None = Depends(tenant)) -> Response:
        stats = await asyncio.to_thread(runtime.cache_stats)
        replicas = await asyncio.to_thread(runtime.replica_stats) if hasattr(runtime, "replica_stats") else None
        return Response(state.metrics.render(stats, replicas), media_type="text/plain; version=0.0.4; charset=utf-8")

    app.state.radixrt = state
    return app


def _sglang_sampling(params: dict[str, Any]) -> dict[str, Any]:
    """A /generate `sampling_params` dict as the runtime takes it; a 400 names the constraint fields
    at the route, where the client's words are known (SGLang's client sends each of them, null
    when unused: null means none)."""
    params = dict(params)
    constrained = [name for name in CONSTRAINT_FIELDS if params.get(name) is not None]
    if len(constrained) > 1:
        raise APIError(400, f"sampling_params: give at most one output constraint of "
                            f"{', '.join(CONSTRAINT_FIELDS)}; got {' and '.join(constrained)}", param="sampling_params")
    if isinstance(params.get("json_schema"), dict):  # as text in the client's key order (constraints._json_text)
        params["json_schema"] = json.dumps(params["json_schema"])
    if constrained and params.get("max_new_tokens") == 0:
        raise APIError(400, f"max_new_tokens must be >= 1 with {constrained[0]}, which constrains generated "
                            "tokens; got 0", param="max_new_tokens")
    return params


def _is_token_list(prompt: Any) -> bool:
    return isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], int)


def _prompt_texts(tokenizer: Any, prompts: list[Any]) -> list[str]:
    return [p if isinstance(p, str) else tokenizer.decode(p) for p in prompts]


def _completion_prompts(prompt: str | list[str] | list[int] | list[list[int]]) -> list[Any]:
    """The prompts of a completion body: a string, a token list, or a list of either."""
    if isinstance(prompt, str) or _is_token_list(prompt):
        return [prompt]
    return list(prompt)


@dataclass
class _StreamProgress:
    """How far a stream's requests got: those that never finish are aborted when it ends."""

    finished: int = 0
    tokens: dict[int, int] = field(default_factory=dict)  # output tokens so far of unfinished requests

    def unfinished_tokens(self) -> int:
        return sum(self.tokens.values())


async def _counting(chunks: AsyncIterator[dict], progress: _StreamProgress) -> AsyncIterator[dict]:
    async for chunk in chunks:
        if chunk["finished"]:
            progress.finished += 1
            progress.tokens.pop(chunk["index"], None)  # counted from its meta_info
        else:
            index = chunk["index"]
            progress.tokens[index] = progress.tokens.get(index, 0) + len(chunk["output_ids"])
        yield chunk


def _as_list(rid: str | list[str]) -> list[str]:
    return rid if isinstance(rid, list) else [rid]


class _EventStream(StreamingResponse):
    """Server-sent events that run `close` when the response ends, however it ends.

    A generator's `finally` is not enough: a client that leaves before the
    first event was pulled never starts the generator, so nothing in it runs.
    """

    def __init__(self, events: AsyncIterator[bytes], close: Callable[[], None]):
        super().__init__(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._close = close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._close()


def _data(payload: Any) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


_DONE = b"data: [DONE]\n\n"


async def _openai_stream(
    state: _State, chunks: AsyncIterator[dict], writer: openai_api.ChunkWriter, num_choices: int,
    samples_per_prompt: int, calls: tuple[str, bool] | None = None, echo: list[str] | None = None,
    logprobs_of: Callable[[int, dict[str, Any]], dict[str, Any] | None] | None = None,
) -> AsyncIterator[bytes]:
    """Role chunks, deltas, one finish per choice, the usage chunk if asked, then [DONE].

    `calls` (the tool-call syntax, and whether parallel calls are kept): deltas split into content
    and `delta.tool_calls` (tool_parsers.StreamedCalls). `echo`: each choice's prompt, sent first.
    `logprobs_of(index, result)`: a choice's log-probs, sent with its finish for all its tokens (the
    engine reports them when the request ends). An error after the stream began is sent as a
    `data: {"error": ...}` event.
    """
    results: list[dict[str, Any] | None] = [None] * num_choices
    output_ids: list[list[int]] = [[] for _ in range(num_choices)]
    splitters = [tool_parsers.StreamedCalls(calls[0]) for _ in range(num_choices)] if calls is not None else None
    try:
        if writer.kind == "chat":
            for index in range(num_choices):
                yield _data(writer.role(index))
        for index, prompt_text in enumerate(echo or []):
            yield _data(writer.delta(index, prompt_text))
        async for chunk in chunks:
            index = chunk["index"]
            output_ids[index].extend(chunk["output_ids"])
            finish = None
            logprobs = None
            if chunk["finished"]:
                meta = chunk["meta_info"]
                finish = meta["finish_reason"]["type"]
                results[index] = {"meta_info": meta}
                state.finished(meta)
                if logprobs_of is not None:
                    logprobs = logprobs_of(index, {"output_ids": output_ids[index], "meta_info": meta})
            if splitters is not None:
                splitter = splitters[index]
                content, call_deltas = splitter.feed(chunk["text"], finish is not None)
                if not calls or not calls[1]:  # parallel_tool_calls false: the first call only
                    call_deltas = [d for d in call_deltas if d["index"] == 0]
                if content:
                    yield _data(writer.delta(index, content))
                for call_delta in call_deltas:
                    yield _data(writer.tool_call_delta(index, call_delta))
                if finish is not None:
                    yield _data(writer.delta(index, "", "tool_calls" if finish == "stop" and splitter.calls_sent
                                             else finish, logprobs))
            elif chunk["text"] or finish is not None:
                yield _data(writer.delta(index, chunk["text"], finish, logprobs))
        if writer.include_usage:
            yield _data(writer.usage(openai_api.usage([r for r in results if r is not None], samples_per_prompt)))
    except RuntimeError as error:
        yield _data(APIError(500, str(error), type_="server_error").body())
    yield _DONE


async def _native_stream(state: _State, chunks: AsyncIterator[dict]) -> AsyncIterator[bytes]:
    """SGLang's streamed /generate: each event carries the text and token ids so far."""
    text: dict[int, str] = {}
    ids: dict[int, list[int]] = {}
    try:
        async for chunk in chunks:
            index = chunk["index"]
            text[index] = text.get(index, "") + chunk["text"]
            ids.setdefault(index, []).extend(chunk["output_ids"])
            meta = chunk.get("meta_info") or {"id": chunk["id"], "finish_reason": None,
                                              "completion_tokens": len(ids[index])}
            if chunk["finished"]:
                state.finished(meta)
            yield _data({"index": index, "text": text[index], "output_ids": ids[index], "meta_info": meta})
    except RuntimeError as error:
        yield _data(APIError(500, str(error), type_="server_error").body())
    yield _DONE


async def _cancel_on_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it (which aborts its requests) if the client disconnects first."""
    task = asyncio.ensure_future(work)

    async def watch() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                task.cancel()
                return

    watcher = asyncio.create_task(watch())
    try:
        return await task
    finally:
        watcher.cancel()

