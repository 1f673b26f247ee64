"""An OpenAI-compatible HTTP server over :class:`flashtree.engine.engine.LLMEngine`.

- ``protocol.py``: the request and response bodies (pydantic);
- ``errors.py``: OpenAI-shaped error responses;
- ``async_engine.py``: the engine on one background thread, requests streamed to asyncio;
- ``generation.py``: an OpenAI request -> prompt ids + sampling parameters;
- ``responses.py``: engine output -> OpenAI responses and SSE chunks;
- ``routes.py``: the endpoints; ``gate.py``: API key and readiness;
- ``metrics.py``: Prometheus metrics; ``startup.py``: memory check, load, warm-up;
- ``app.py``: the FastAPI app factory; ``cli.py``: ``flashtree serve``.
"""
