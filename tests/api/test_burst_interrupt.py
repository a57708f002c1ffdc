"""Every command sent to the engine thread raises the engine's burst interrupt (which ends a running burst after
its token in flight: tests/engine/test_native_step.py), and the engine thread lowers it as it takes the commands,
under the lock they are sent under."""

import time

from corral.api.async_engine import AsyncEngine
from corral.engine.llm_engine import BurstInterrupt
from corral.models import load_tokenizer

from api_fakes import FakeCompiler, FakeEngine


class InterruptibleEngine(FakeEngine):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.burst_interrupt = BurstInterrupt()


def test_a_command_raises_the_burst_interrupt_until_the_engine_thread_takes_it():
    engine = InterruptibleEngine(load_tokenizer(), lambda prompt_ids, params: "hi")
    async_engine = AsyncEngine(engine, FakeCompiler())
    try:
        with async_engine._wake:  # the engine thread cannot take the command while this is held
            async_engine._send(("abort", "nobody"))
            assert engine.burst_interrupt.flag[0] == 1
        deadline = time.monotonic() + 10
        while engine.burst_interrupt.flag[0] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert engine.burst_interrupt.flag[0] == 0 and not async_engine._commands
    finally:
        async_engine.shutdown()
