"""The HTTP connection itself, guarded against slow and large clients (uvicorn protocol).

Uvicorn's httptools protocol reads request headers without a size or time limit, and a
connection that never sends a byte is never closed. `GuardedHttpProtocol` (pass it as
uvicorn's `http=`; `elastrain serve` does) adds, per connection:

- **Header size**: at most `max_header_bytes` before the headers end, counted before the
  parser sees them; past it, a 431 and the connection closed (its rest read and dropped
  for a moment, so the client sees the answer rather than a reset).
- **Header time**: a request's headers must be complete within `header_timeout_s` of its
  first byte, and a new connection must send them within that long too; else a 408 and
  the connection closed (slowloris, half-open connections).
- **Keep-alive**: an idle connection between requests closes after uvicorn's
  `timeout_keep_alive`.
- **Connection limit**: at most `max_connections`; a new one past it closes the oldest
  connection still waiting for its headers (an abuser's idle socket goes, a working client
  gets in), or, when every connection is busy with a request, is answered 503 and closed.

Limits come from `ELASTRAIN_*` settings (`ConnectionLimits.from_settings`) unless a
subclass sets `limits` (tests), so `uvicorn --http elastrain.api.http_guard:GuardedHttpProtocol`
and every `--workers` process get the same ones.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any, ClassVar

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

#: How long a refused connection stays open after its answer (so a client still sending
#: reads the answer rather than a reset), and how much more of it is read and dropped
#: meanwhile: past that, reading stops (the client's sends block), so a client that keeps
#: sending costs the server nothing more.
LINGER_S = 1.0
LINGER_BYTES = 1 << 20


@dataclass(frozen=True, kw_only=True, slots=True)
class ConnectionLimits:
    max_header_bytes: int = 64 * 1024
    header_timeout_s: float = 10.0
    max_connections: int = 2048

    @classmethod
    def from_settings(cls) -> ConnectionLimits:
        from elastrain.service.settings import Settings

        s = Settings()
        return cls(
            max_header_bytes=s.max_header_bytes,
            header_timeout_s=s.header_timeout_s,
            max_connections=s.max_connections,
        )


def _answer(status: int, reason: str, detail: str) -> bytes:
    body = f'{{"detail": "{detail}"}}'.encode()
    head = (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode() + body


class GuardedHttpProtocol(HttpToolsProtocol):
    limits: ClassVar[ConnectionLimits | None] = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if type(self).limits is None:
            type(self).limits = ConnectionLimits.from_settings()
        self._limits: ConnectionLimits = type(self).limits  # type: ignore[assignment]
        self._in_headers = True
        self._header_bytes = 0
        self._waiting_since = time.monotonic()
        self._header_timer: asyncio.TimerHandle | None = None
        self._dropping = False
        self._dropped = 0

    # --- connection limit -------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        if len(self.connections) >= self._limits.max_connections and not self._evict_idle():
            super().connection_made(transport)
            self._refuse(503, "Service Unavailable", "too many connections; retry shortly")
            return
        super().connection_made(transport)
        self._arm_header_timer()

    def _evict_idle(self) -> bool:
        """Close the connection that has waited longest for its headers; False if none."""
        idle = [c for c in self.connections if isinstance(c, GuardedHttpProtocol) and c._idle()]
        if not idle:
            return False
        oldest = min(idle, key=lambda c: c._waiting_since)
        oldest._refuse(503, "Service Unavailable", "connection closed: too many connections")
        return True

    def _idle(self) -> bool:
        """Waiting for a request's headers, with no request of its own in progress."""
        busy = self.cycle is not None and not self.cycle.response_complete
        return self._in_headers and not busy and not self._dropping

    # --- header size and time -----------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        if self._dropping:  # refused: what is still coming is dropped until it closes
            self._dropped += len(data)
            if self._dropped > LINGER_BYTES:
                self.transport.pause_reading()
            return
        if not self._in_headers:
            super().data_received(data)
            return
        if self._header_timer is None:
            self._waiting_since = time.monotonic()
            self._arm_header_timer()
        room = self._limits.max_header_bytes - self._header_bytes
        head = data[: max(room, 0)]
        self._header_bytes += len(head)
        super().data_received(head)
        rest = data[len(head) :]
        if not rest or self.transport.is_closing():
            return
        if self._in_headers:
            self._refuse(
                431,
                "Request Header Fields Too Large",
                f"request headers over {self._limits.max_header_bytes} bytes",
            )
            return
        self.data_received(rest)  # the body, or pipelined requests (counted again)

    def on_headers_complete(self) -> None:
        self._in_headers = False
        self._header_bytes = 0
        self._cancel_header_timer()
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        # The next request's headers are counted (and timed from its first byte).
        self._in_headers = True

    def _arm_header_timer(self) -> None:
        self._cancel_header_timer()
        self._header_timer = self.loop.call_later(
            self._limits.header_timeout_s, self._header_timeout
        )

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _header_timeout(self) -> None:
        self._header_timer = None
        if self._in_headers and not self.transport.is_closing():
            if self._header_bytes == 0 and self.cycle is not None:
                self.transport.close()  # an idle keep-alive connection: just close it
                return
            self._refuse(408, "Request Timeout", "request headers not received in time")

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._cancel_header_timer()  # idle now: uvicorn's keep-alive timeout applies

    # --- refusing ----------------------------------------------------------------------

    def _refuse(self, status: int, reason: str, detail: str) -> None:
        """Answer, stop reading requests, and close after a short linger (so a client
        still sending sees the answer, not a connection reset)."""
        self._cancel_header_timer()
        self._dropping = True
        self._in_headers = False
        transport = self.transport
        if transport.is_closing():
            return
        transport.write(_answer(status, reason, detail))
        try:
            transport.write_eof()
        except (NotImplementedError, OSError, RuntimeError):
            transport.close()
            return
        self.loop.call_later(LINGER_S, transport.close)

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        super().connection_lost(exc)
