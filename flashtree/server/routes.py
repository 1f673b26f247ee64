"""The endpoints: chat and text completions (whole or streamed), models, tokenize / detokenize, health,
version, metrics."""

from __future__ import annotations

import asyncio
import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from fastapi.routing import APIRoute
from starlette.background import BackgroundTask

from flashtree.server.anthropic import (
    MessagesRequest,
    message_events,
    message_id,
    message_response,
    messages_input,
)
from flashtree.server.async_engine import AsyncEngine, EngineState
from flashtree.server.errors import APIError, from_engine_error
from flashtree.server.generation import (
    GenerationInput,
    ServedModel,
    chat_input,
    completion_input,
    detokenize_input,
    tokenize_input,
)
from flashtree.server.metrics import CONTENT_TYPE
from flashtree.server.openai_responses import (
    ResponseIds,
    ResponsesRequest,
    ResponseStore,
    finished_response,
    response_events,
    responses_input,
)
from flashtree.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)
from flashtree.server.responses import (
    SSE_HEADERS,
    chat_events,
    chat_response,
    completion_events,
    completion_response,
    last_delta,
    new_id,
)
from flashtree.server.stream import EngineFailure, GenerationDelta, RequestStream
from flashtree.version import __version__

CLIENT_CLOSED_REQUEST = 499  # nginx's status for a client that left; nobody reads it
PLAYGROUND_HTML = (Path(__file__).parent / "playground.html").read_text(encoding="utf-8")


class ServerContext:
    """What the endpoints share: the async engine (or the data-parallel replicas, ``server/replicas.py``) and
    the served model's name."""

    def __init__(self, engine: AsyncEngine, model_name: str, responses_store_size: int = 1024):
        self.engine = engine
        self.model_name = model_name
        self.responses = ResponseStore(responses_store_size)  # stored /v1/responses
        self.served: ServedModel | None = None  # set on the engine thread once loaded, before ready
        # requests are tokenized here, one at a time (the HTTP side's tokenizer is not shared across threads)
        self.tokenizing = ThreadPoolExecutor(max_workers=1, thread_name_prefix="flashtree-tokenize")

    async def tokenize(self, make_input, body, model: ServedModel):
        """``make_input(body, model)`` on the tokenizing thread, so a huge prompt never holds up the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self.tokenizing, make_input, body, model)

    def model(self, requested: str) -> ServedModel:
        if requested != self.model_name:
            raise APIError(404, f"the model {requested!r} does not exist; this server serves {self.model_name!r}",
                           param="model", code="model_not_found")
        return self.served

    def not_ready_reason(self) -> str | None:
        state = self.engine.state
        if state is EngineState.READY:
            return None
        if self.engine.fatal_error is not None:
            return self.engine.fatal_error
        if state is EngineState.FAILED:
            return f"the model failed to load: {self.engine.load_error}"
        return f"the model is {state.value}; retry when GET /health answers 200"

    async def submit(self, generation: GenerationInput, choices: int, prompt_field: str, arrival: float
                     ) -> list[RequestStream]:
        """One engine request per choice (the later ones wait for the first's prompt and share its
        pages); a refusal of any cancels the ones already queued."""
        streams: list[RequestStream] = []
        try:
            for index in range(choices):
                choice = generation.choice(index)
                streams.append(await self.engine.submit(choice.prompt_ids, choice.params, choice.budget, arrival,
                                                        after=streams[0] if streams else None,
                                                        speculation=choice.speculation))
        except Exception as err:  # refusals from add_request: 400 / 429
            for stream in streams:
                self.engine.cancel(stream)
            raise from_engine_error(err, prompt_field) from None
        return streams

    def cancel_all(self, streams: list[RequestStream]) -> None:
        for stream in streams:
            self.engine.cancel(stream)

    async def finish(self, streams: list[RequestStream], request: Request) -> list[GenerationDelta] | None:
        """The requests' last deltas, or None when the client left first (the requests are aborted)."""
        results = [asyncio.ensure_future(last_delta(stream)) for stream in streams]
        watcher = asyncio.ensure_future(_client_left(request))
        try:
            pending = set(results)
            while pending and not watcher.done():
                done, _ = await asyncio.wait(pending | {watcher}, return_when=asyncio.FIRST_COMPLETED)
                pending -= done
        finally:
            watcher.cancel()
            if not all(r.done() for r in results):
                for r in results:
                    r.cancel()
                self.cancel_all(streams)
        if not all(r.done() and not r.cancelled() for r in results):  # the client left first
            await asyncio.gather(*results, return_exceptions=True)  # (collects the cancelled tasks)
            return None
        try:
            return [r.result() for r in results]
        except EngineFailure as err:  # (its message names the incident the log holds, or the lost engine's cause)
            self.cancel_all(streams)
            raise APIError(err.status, str(err), code=err.code) from None


async def _client_left(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


LARGE_BODY_BYTES = 1 << 20  # a JSON body larger than this is parsed on a worker thread


class OffLoopJSONRequest(Request):
    """A request whose large JSON body is parsed on a worker thread: decoding megabytes on the event
    loop would hold up every stream for that long."""

    async def json(self):
        if not hasattr(self, "_json"):
            body = await self.body()
            if len(body) > LARGE_BODY_BYTES:
                self._json = await asyncio.get_running_loop().run_in_executor(None, json.loads, body)
            else:
                self._json = json.loads(body)
        return self._json


class OffLoopJSONRoute(APIRoute):
    def get_route_handler(self):
        handler = super().get_route_handler()

        async def route(request: Request):
            return await handler(OffLoopJSONRequest(request.scope, request.receive))

        return route


def event_stream(events, ctx: ServerContext, streams: list[RequestStream]) -> StreamingResponse:
    """An SSE response; the background cancel covers a client that left before the first event."""
    return StreamingResponse(events, media_type="text/event-stream", headers=SSE_HEADERS,
                             background=BackgroundTask(ctx.cancel_all, streams))


def build_router(ctx: ServerContext) -> APIRouter:
    router = APIRouter(route_class=OffLoopJSONRoute)

    async def serve(body, request: Request, make_input, prompt_field: str, id_prefix: str, events, respond):
        """One generation endpoint: submit, then stream the events or answer with the whole result."""
        arrival = time.monotonic()
        model = ctx.model(body.model)
        generation = await ctx.tokenize(make_input, body, model)
        streams = await ctx.submit(generation, body.n, prompt_field, arrival)
        response_id = new_id(id_prefix)
        if body.stream:
            return event_stream(events(streams, response_id, model.name, body.include_usage, ctx.engine.cancel,
                                       echo=generation.echo, logprobs=generation.params.logprobs is not None,
                                       tools=generation.tools), ctx, streams)
        finals = await ctx.finish(streams, request)
        if finals is None:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        return respond(response_id, model.name, finals, echo=generation.echo, tools=generation.tools)

    @router.post("/v1/chat/completions")
    async def create_chat_completion(body: ChatCompletionRequest, request: Request):
        return await serve(body, request, chat_input, "messages", "chatcmpl", chat_events, chat_response)

    @router.post("/v1/completions")
    async def create_completion(body: CompletionRequest, request: Request):
        return await serve(body, request, completion_input, "prompt", "cmpl", completion_events, completion_response)

    @router.post("/v1/messages")
    async def create_message(body: MessagesRequest, request: Request):
        """Anthropic's Messages API over the same request path (``server/anthropic.py``)."""
        arrival = time.monotonic()
        model = ctx.model(body.model)
        generation = await ctx.tokenize(messages_input, body, model)
        streams = await ctx.submit(generation, 1, "messages", arrival)
        response_id, stops = message_id(), tuple(body.stop_sequences or ())
        if body.stream:
            events = message_events(streams[0], response_id, model.name, len(generation.prompt_ids), stops,
                                    ctx.engine.cancel, generation.tools)
            return event_stream(events, ctx, streams)
        finals = await ctx.finish(streams, request)
        if finals is None:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        return JSONResponse(message_response(response_id, model.name, finals[0], stops, generation.tools))

    @router.post("/v1/responses")
    async def create_response(body: ResponsesRequest, request: Request):
        """OpenAI's Responses API over the same request path (``server/openai_responses.py``)."""
        arrival = time.monotonic()
        model = ctx.model(body.model)
        generation, conversation = await ctx.tokenize(lambda b, m: responses_input(b, m, ctx.responses), body, model)
        streams = await ctx.submit(generation, 1, "input", arrival)
        ids = ResponseIds()
        if body.stream:
            events = response_events(streams[0], ids, body, model.name, conversation, ctx.responses, ctx.engine.cancel,
                                     generation.tools)
            return event_stream(events, ctx, streams)
        finals = await ctx.finish(streams, request)
        if finals is None:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        return JSONResponse(finished_response(ids, body, model.name, finals[0], conversation, ctx.responses,
                                              generation.tools))

    @router.get("/v1/responses/{response_id}")
    async def retrieve_response(response_id: str):
        return JSONResponse(ctx.responses.get(response_id)[0])

    @router.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str):
        ctx.responses.delete(response_id)
        return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})

    @router.get("/v1/models")
    async def list_models() -> ModelList:
        return ModelList(data=[ModelCard(id=ctx.model_name, max_model_len=ctx.served.max_context)])

    @router.get("/v1/models/{model_id:path}")
    async def retrieve_model(model_id: str) -> ModelCard:
        return ModelCard(id=ctx.model(model_id).name, max_model_len=ctx.served.max_context)

    @router.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> TokenizeResponse:
        model = ctx.served if body.model is None else ctx.model(body.model)
        ids = await ctx.tokenize(tokenize_input, body, model)
        return TokenizeResponse(count=len(ids), max_model_len=model.max_context, tokens=ids)

    @router.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        model = ctx.served if body.model is None else ctx.model(body.model)
        return DetokenizeResponse(prompt=await ctx.tokenize(detokenize_input, body, model))

    @router.get("/", include_in_schema=False)
    async def playground() -> HTMLResponse:
        """A chat page that draws each answer's rounds and draft trees (``server/playground.html``)."""
        return HTMLResponse(PLAYGROUND_HTML)

    @router.get("/version")
    async def version():
        return JSONResponse({"version": __version__})

    @router.get("/health")
    async def health():
        reason = ctx.not_ready_reason()
        if reason is not None:
            return APIError(503, reason, code="model_not_ready").response()
        return JSONResponse({"status": "ok"})

    @router.get("/metrics")
    async def metrics() -> Response:
        return Response(ctx.engine.metrics.render(), media_type=CONTENT_TYPE)

    return router
