"""EventStream: the SSE response of a streaming request, which owns the request's admission ticket.

Two things a plain ``StreamingResponse`` does not do. The ticket is given back when the response ends, however
it ends (done, client gone, an error), so ``max_in_flight`` counts a streaming request until its last byte. And
every send has a deadline: a client that stops reading fills the socket's buffers, the send waits, and after
``send_timeout_s`` the response gives up, which closes its event source (aborting the engine request and
freeing its KV blocks) instead of holding them for as long as the reader dawdles. subtle: the send only waits
once uvicorn's write buffer (64 KiB) and the kernel's socket buffers are full, about a thousand events; a
request that ends sooner frees its blocks at ``max_tokens`` anyway.
"""

import asyncio
import logging

from starlette.responses import StreamingResponse

logger = logging.getLogger(__name__)


class SendTimeoutError(Exception):
    """The client took no data for ``send_timeout_s``."""


class EventStream(StreamingResponse):
    def __init__(self, events, outputs, ticket, send_timeout_s: float):
        """``events``: the SSE lines, made from ``outputs`` (the engine request's output stream, closed here
        even when the events never started)."""
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.outputs, self.ticket, self.send_timeout_s = outputs, ticket, send_timeout_s

    async def __call__(self, scope, receive, send) -> None:
        async def send_in_time(message) -> None:
            try:
                async with asyncio.timeout(self.send_timeout_s):  # a timer, not a task per event (wait_for's)
                    await send(message)
            except TimeoutError:
                raise SendTimeoutError(f"the client read nothing for {self.send_timeout_s:g} s") from None

        try:
            await super().__call__(scope, receive, send_in_time)
        except SendTimeoutError as err:
            logger.warning("ending a stream: %s", err)
        finally:
            await self.body_iterator.aclose()
            await self.outputs.aclose()  # aborts the engine request if it is still running
            self.ticket.release()
