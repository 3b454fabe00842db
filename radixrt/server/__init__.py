"""`radixrt serve`: the HTTP server (OpenAI-compatible and SGLang-native) over one `Runtime`.

`app.create_app(runtime, settings)` builds the FastAPI app; `launch.serve`
runs it with uvicorn. Importing this package needs the `serve` extra
(fastapi, uvicorn, orjson, prometheus_client).
"""
