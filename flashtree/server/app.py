"""The FastAPI app factory: ``create_app(ServerConfig)``.

The engine loads in its own process (CUDA) or on its own thread (CPU; ``ServerConfig.runs_engine_process``)
when the app starts (lifespan), so ``/health`` answers 503 while loading and 200 once the warm-up generation is
done. With ``data_parallel_size`` N > 1, N engines load side by side, each on its own thread or
process and devices, behind a router (``server/replicas.py``); ``/health`` answers 200 once all are ready.
"""

from __future__ import annotations

import contextlib
from typing import Callable

from fastapi import FastAPI

from flashtree.config import EngineConfig
from flashtree.server.async_engine import AsyncEngine, EngineRunner, EngineThread
from flashtree.server.config import ServerConfig
from flashtree.server.engine_process import EngineProcess
from flashtree.server.errors import install_error_handlers
from flashtree.server.generation import EngineInfo, ServedModel
from flashtree.server.metrics import ServerMetrics
from flashtree.server.middleware import BodyLimit, Gate, ResponseCounter
from flashtree.server.replicas import ReplicaSet, replica_configs
from flashtree.server.router import PrefixRouter
from flashtree.server.routes import ServerContext, build_router
from flashtree.server.startup import load_for_serving


def create_app(config: ServerConfig, *,
               on_load_failure: Callable[[BaseException], None] | None = None,
               on_fatal: Callable[[str], None] | None = None) -> FastAPI:
    """The app; ``on_load_failure(error)`` when the model fails to load, ``on_fatal(cause)`` (any
    thread) when the loaded engine is lost (a tensor-parallel worker died): it answers 503 from then on."""
    metrics = ServerMetrics()

    def on_ready(info: EngineInfo, compile_structured: Callable | None) -> None:  # (any thread)
        ctx.served = ServedModel.of(info, config.model_name, compile_structured)
        metrics.set_engine_info(config.model_name, info.method, info.device, info.dtype)

    def runner(engine_config: EngineConfig, replica: int) -> EngineRunner:
        if config.runs_engine_process:
            return EngineProcess(engine_config, config.freeze_gc, config.log_level, replica)
        return EngineThread(lambda: load_for_serving(engine_config, config.freeze_gc))

    if config.data_parallel_size == 1:
        async_engine = AsyncEngine(runner(config.engine, 0), metrics, on_ready, on_load_failure, on_fatal)
    else:
        engine_configs = replica_configs(config.engine, config.data_parallel_size)

        def make_replica(index: int, **callbacks) -> AsyncEngine:
            return AsyncEngine(runner(engine_configs[index], index), metrics, on_ready, replica=index, **callbacks)

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
