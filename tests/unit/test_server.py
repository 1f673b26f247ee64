"""The server's pure mappings: engine refusals to OpenAI statuses, validation errors to the nested
field's name. (The server end to end: tests/integration/test_server.py.)"""

from __future__ import annotations


def test_engine_refusals_map_to_openai_statuses():
    from flashtree.engine.scheduler import PromptTooLongError, QueueFullError
    from flashtree.errors import RequestError
    from flashtree.server.errors import from_engine_error
    from flashtree.server.stream import EngineUnavailable

    busy = from_engine_error(QueueFullError("3 requests are waiting"), "prompt")
    assert (busy.status, busy.code, busy.headers["Retry-After"]) == (429, "queue_full", "1")
    assert from_engine_error(PromptTooLongError("the prompt has 9 tokens"), "messages").status == 400
    empty = from_engine_error(RequestError("the prompt is empty; give at least one token"), "messages")
    assert (empty.status, empty.param) == (400, "messages")
    sampling = from_engine_error(RequestError("top_k must be an integer >= 0"), "prompt")
    assert (sampling.status, sampling.param) == (400, "top_k")
    assert from_engine_error(EngineUnavailable("the engine is stopping"), "prompt").status == 503
    assert from_engine_error(KeyError("bug"), "prompt").status == 500


def test_validation_errors_name_the_nested_field():
    from flashtree.server.errors import validation_error

    err = validation_error([{"type": "literal_error", "loc": ("body", "messages", 0, "content", "list[TextPart]", 1,
                                                              "type"), "msg": "Input should be 'text'"}])
    assert (err.status, err.param) == (400, "messages[0].content[1].type")
    assert err.message == "messages[0].content[1].type: Input should be 'text'"
