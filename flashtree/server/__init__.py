"""An OpenAI-compatible HTTP server over :class:`flashtree.engine.engine.LLMEngine`.

- ``config.py``: ServerConfig (frozen); ``cli.py``: ``flashtree serve``; ``app.py``: the app factory;
- ``protocol.py``: request and response bodies (pydantic); ``errors.py``: OpenAI-shaped errors;
- ``async_engine.py``: the engine on one background thread, requests streamed to asyncio;
- ``generation.py``: an OpenAI request -> prompt ids + SamplingParams;
- ``responses.py``: engine output -> OpenAI responses and SSE chunks;
- ``routes.py``: the endpoints; ``middleware.py``: API key, readiness, response counts;
- ``metrics.py``: Prometheus metrics; ``startup.py``: memory check, load, warm-up.
"""
