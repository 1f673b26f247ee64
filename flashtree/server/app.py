"""The FastAPI app factory: ``create_app(ServerConfig)``.

The engine loads on its own thread when the app starts (lifespan), so ``/health`` answers
503 while loading and 200 once the warm-up generation is done. With ``data_parallel_size`` N > 1,
N engines load side by side, each on its own thread and devices, behind a router
(``server/replicas.py``); ``/health`` answers 200 once all are ready.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Callable

from fastapi import FastAPI

from flashtree.config import EngineConfig
from flashtree.engine.engine import LLMEngine
from flashtree.server.async_engine import AsyncEngine
from flashtree.server.config import ServerConfig
from flashtree.server.errors import install_error_handlers
from flashtree.server.generation import ServedModel
from flashtree.server.metrics import ServerMetrics
from flashtree.server.middleware import BodyLimit, Gate, ResponseCounter
from flashtree.server.replicas import ReplicaSet, replica_configs
from flashtree.server.router import PrefixRouter
from flashtree.server.routes import ServerContext, build_router
from flashtree.server.startup import freeze_startup_objects, load_engine

log = logging.getLogger("flashtree.server")


def create_app(config: ServerConfig, *,
               on_load_failure: Callable[[BaseException], None] | None = None,
               on_fatal: Callable[[str], None] | None = None) -> FastAPI:
    """The app; ``on_load_failure(error)`` when the model fails to load, ``on_fatal(cause)`` (any
    thread) when the loaded engine is lost (a tensor-parallel worker died): it answers 503 from then on."""
    metrics = ServerMetrics()

    def load(engine_config: EngineConfig) -> LLMEngine:  # on the engine thread
        engine = load_engine(engine_config)
        if config.freeze_gc:
            log.info("%d startup objects exempt from garbage collection", freeze_startup_objects())
        ctx.served = ServedModel.of(engine, config.model_name)
        metrics.engine_info.labels(model=config.model_name, method=engine.proposer.name,
                                   device=str(engine.device), dtype=str(engine.dtype)).set(1)
        return engine

    if config.data_parallel_size == 1:
        async_engine = AsyncEngine(lambda: load(config.engine), metrics, on_load_failure, on_fatal)
    else:
        engine_configs = replica_configs(config.engine, config.data_parallel_size)

        def make_replica(index: int, **callbacks) -> AsyncEngine:
            return AsyncEngine(lambda: load(engine_configs[index]), metrics, replica=index, **callbacks)

        router = PrefixRouter(config.data_parallel_size, config.engine.cache.page_size,
                              max_imbalance=config.engine.scheduler.max_running)
        async_engine = ReplicaSet(config.data_parallel_size, make_replica, metrics, router, on_load_failure, on_fatal)
    ctx = ServerContext(async_engine, config.model_name, config.responses_store_size)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        async_engine.start()
        try:
            yield
        finally:
            async_engine.stop()
            ctx.tokenizing.shutdown(wait=False)

    app = FastAPI(title="flashtree", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.flashtree = ctx
    install_error_handlers(app)
    app.include_router(build_router(ctx))
    app.add_middleware(BodyLimit, max_bytes=config.max_request_bytes)
    app.add_middleware(Gate, api_key=config.api_key, not_ready_reason=ctx.not_ready_reason)
    app.add_middleware(ResponseCounter, metrics=metrics)  # outermost: counts 401/503/413 too
    return app
