"""The server's engine loop (serve/loop.py) without HTTP: it steps a busy engine back to back
and sleeps only when idle, and the tokens it streams equal `LLM.generate`'s."""

from __future__ import annotations

import threading

from sparse_framework.engine import LLM, SamplingParams
from sparse_framework.cli.engine import DEMO_CONFIG
from sparse_framework.serve.loop import EngineLoop, Event


class CountingWake(threading.Event):
    """The loop's wake-up event, counting the waits made while the engine still had work."""

    def __init__(self, loop: EngineLoop) -> None:
        super().__init__()
        self.loop = loop
        self.busy_waits = 0

    def wait(self, timeout: float | None = None) -> bool:
        if self.loop.engine.has_unfinished():
            self.busy_waits += 1
        return super().wait(timeout)


def test_a_busy_engine_is_stepped_without_waiting_between_steps() -> None:
    """A wait between the steps of a running batch adds its timeout to every token (the H100
    sweep's first run: ~55 ms between tokens whatever the model): none may happen."""
    llm = LLM(None, DEMO_CONFIG, max_num_seqs=4, max_model_len=256)
    params = SamplingParams(max_tokens=24, temperature=0.0)
    prompts = [[1, 17, 300, 5, 9], [4, 5, 6, 7, 8, 9, 10]]
    expected = [o.token_ids for o in llm.generate(prompts, params)]
    loop = EngineLoop(llm.engine)
    wake = loop._wake = CountingWake(loop)
    loop.start()
    assert loop.ready.wait(60)
    done = {rid: threading.Event() for rid in ("a", "b")}
    streamed: dict[str, list[int]] = {"a": [], "b": []}

    def sink_for(rid: str):  # type: ignore[no-untyped-def]
        def sink(event: Event) -> None:
            streamed[rid] += event.tokens
            if event.output is not None:
                done[rid].set()
        return sink

    try:
        for rid, prompt in zip(("a", "b"), prompts):
            loop.submit(rid, prompt, params, sink_for(rid))
        assert all(e.wait(60) for e in done.values())
    finally:
        loop.stop()
    assert [streamed["a"], streamed["b"]] == expected
    assert wake.busy_waits == 0
