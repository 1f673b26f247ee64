"""The server side of an engine process without the process: what ``EngineProcess`` sends for a submit and
an abort, and how the messages that come back reach the streams (a cancelled stream gets nothing more, a last
delta or a refusal forgets the stream, metric calls are replayed, a bad message does not stop the others)."""

from __future__ import annotations

import asyncio

import pytest

from flashtree.errors import RequestError
from flashtree.sampling import SamplingParams
from flashtree.server.async_engine import AsyncEngine
from flashtree.server.engine_driver import Abort, Submit
from flashtree.server.engine_process import EngineProcess
from flashtree.server.metrics import ServerMetrics, StepFigures
from flashtree.server.stream import GenerationDelta, RequestStream, RequestUsage


class Sent:
    def __init__(self):
        self.messages = []

    def send(self, message):
        self.messages.append(message)


@pytest.fixture
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def settle(loop) -> None:
    """Run the callbacks the reader posted."""
    loop.run_until_complete(asyncio.sleep(0))


def test_submits_and_aborts_cross_as_keys_and_deltas_come_back_to_their_streams(loop):
    runner, pipe = EngineProcess(config=None), Sent()
    runner._commands = pipe
    front = AsyncEngine(runner, ServerMetrics())
    first, second = RequestStream(loop), RequestStream(loop)
    runner.send(Submit(first, [1, 2], SamplingParams(), None, 0.0))
    runner.send(Submit(second, [1, 2], SamplingParams(), 4, 0.0, after=first, speculation=True))
    assert [m[1] for m in pipe.messages] == [Submit(first.key, [1, 2], SamplingParams(), None, 0.0),
                                             Submit(second.key, [1, 2], SamplingParams(), 4, 0.0, first.key, True)]
    assert runner.in_flight() == 2
    runner.send(Abort(second))
    assert pipe.messages[-1] == ("abort", second.key) and runner.in_flight() == 1

    usage = RequestUsage(2, 2, 1, 1.0)
    runner._dispatch(front, "settle", first.key, None)
    runner._dispatch(front, "deliver", [(first.key, GenerationDelta((7,), " a", None)),
                                        (second.key, GenerationDelta((8,), " b", None))])  # (second: cancelled)
    runner._dispatch(front, "deliver", [(first.key, GenerationDelta((9,), " c", usage, finish_reason="length"))])
    settle(loop)
    assert first.admitted.done() and first.admitted.exception() is None
    assert [first.deltas.get_nowait().token_ids for _ in range(2)] == [(7,), (9,)]
    assert second.deltas.empty() and runner.in_flight() == 0  # the last delta forgot the first stream


def test_a_refusal_forgets_its_stream_and_metrics_are_replayed(loop):
    runner, metrics = EngineProcess(config=None), ServerMetrics()
    runner._commands = Sent()
    front = AsyncEngine(runner, metrics)
    refused = RequestStream(loop)
    runner.send(Submit(refused, [1], SamplingParams(), None, 0.0))
    runner._dispatch(front, "settle", refused.key, RequestError("prompt too long"))
    runner._dispatch(front, "metric", "observe_step", (StepFigures(generated=5, inter_token=[(0.01, 4)]), 0), {})
    settle(loop)
    with pytest.raises(RequestError, match="prompt too long"):
        refused.admitted.result()
    assert runner.in_flight() == 0
    assert metrics.inter_token_latency.count == 4
    assert metrics.registry.get_sample_value("flashtree_generation_tokens_total") == 5


def test_a_message_that_cannot_be_applied_does_not_stop_the_rest(loop, caplog):
    runner = EngineProcess(config=None)
    runner._commands = Sent()
    front = AsyncEngine(runner, ServerMetrics())
    stream = RequestStream(loop)
    runner.send(Submit(stream, [1], SamplingParams(), None, 0.0))
    batches = [[("metric", "observe_step", ("not figures", 0), {})],
               [("deliver", [(stream.key, GenerationDelta((3,), " x", None))])]]

    class Events:
        def recv(self):
            if not batches:
                raise EOFError
            return batches.pop(0)

    runner._events, runner._stopping = Events(), True  # (stopping: the closed pipe is expected)
    runner._read(front)
    settle(loop)
    assert stream.deltas.get_nowait().token_ids == (3,)
    assert "could not be applied" in caplog.text
