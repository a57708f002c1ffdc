"""Connections a slow or idle client cannot hold: the HTTP protocol ``corral serve`` runs under uvicorn.

uvicorn as shipped waits for a request's headers forever: a connection that sends nothing, or half a header line
and then nothing (slowloris), keeps its socket and file descriptor until the client leaves, so a few thousand
such connections from one host use up the process's descriptors and no one else gets in. This protocol adds two
bounds (uvicorn's keep-alive timer, 5 s after a response, still closes idle keep-alive connections sooner):

- **headers in time**: a connection must complete a request's headers within ``header_timeout_s`` of opening, or
  of its previous response; else it is closed (with a 408 where the client had sent part of a request);
- **a cap on open connections**: past ``max_connections`` a new connection is answered 503 and closed at once.

A header is at most 16 KiB (h11's default; past it the client gets a 400). The body's own deadline is
``GuardMiddleware``'s (``corral.api.server``): the route reads it, so the 408 there is an ordinary error body.
What this leaves out: a client may still trickle a body until that deadline, and hold a streamed response as
long as it reads (``send_timeout_s`` ends one that does not); rate limits per client belong in front of the
server.
"""

import json
import logging
import resource

from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger(__name__)

# descriptors kept back from the connection cap: the model's files, the compile pool, logs, the listening socket
_RESERVED_FDS = 128


def raw_error(status: int, reason: str, message: str, code: str) -> bytes:
    """A whole ``Connection: close`` response with an OpenAI-shaped error body, written to the socket directly
    (no request was parsed, so h11 has nothing to answer)."""
    body = json.dumps({"error": {"message": message, "type": "server_error" if status >= 500 else
                                 "invalid_request_error", "param": None, "code": code}}).encode()
    head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            "connection: close\r\n\r\n")
    return head.encode("latin-1") + body


def connection_cap(wanted: int) -> int:
    """``wanted``, or less where the process's descriptor limit would run out first."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or wanted <= soft - _RESERVED_FDS:
        return wanted
    cap = max(1, soft - _RESERVED_FDS)
    log.warning("max_connections %d lowered to %d: the process may open %d descriptors (ulimit -n)", wanted, cap,
                soft)
    return cap


def guarded_protocol(header_timeout_s: float, max_connections: int) -> type:
    """uvicorn's h11 protocol with the two bounds above (pass it as ``uvicorn.Config(http=...)``)."""
    assert header_timeout_s > 0 and max_connections > 0

    class GuardedH11Protocol(H11Protocol):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self.header_timer, self.waiting_after = None, None
            if len(self.connections) > max_connections:
                message = f"The server holds its limit of {max_connections} connections; retry later."
                transport.write(raw_error(503, "Service Unavailable", message, "too_many_connections"))
                transport.close()
                return
            self.arm_header_timer()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():  # the next request's headers are due within the same bound
                self.arm_header_timer()

        def connection_lost(self, exc) -> None:
            if getattr(self, "header_timer", None) is not None:
                self.header_timer.cancel()
                self.header_timer = None
            super().connection_lost(exc)

        def arm_header_timer(self) -> None:
            if self.header_timer is not None:
                self.header_timer.cancel()
            self.waiting_after = self.cycle  # a request whose headers complete replaces it
            self.header_timer = self.loop.call_later(header_timeout_s, self.headers_late)

        def headers_late(self) -> None:
            self.header_timer = None
            cycle = self.cycle
            if cycle is not self.waiting_after or (cycle is not None and not cycle.response_complete) \
                    or self.transport.is_closing():
                return  # a request arrived in time (a pipelined one may already be running)
            partial, _ = self.conn.trailing_data
            if partial:
                message = f"The request's headers did not arrive within {header_timeout_s:g} s."
                self.transport.write(raw_error(408, "Request Timeout", message, "request_timeout"))
            self.transport.close()

    return GuardedH11Protocol
