"""OpenAI-compatible HTTP server: ``specstream serve`` or ``build_app(llm, ServerConfig(...))``.

``app`` (routes and guards) -> ``serving`` (requests to engine jobs, JSON and SSE) ->
``async_engine`` (the engine-loop thread) ; ``protocol`` (request models, error bodies) and
``metrics`` (Prometheus text) on the side. FastAPI and uvicorn are the ``serve`` extra, so
nothing here is imported by ``import specstream``.
"""
