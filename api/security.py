"""What every request passes before a route sees it, and what every response carries.

One pure ASGI middleware (no per-request task or copy, unlike `BaseHTTPMiddleware`):

- **Host check** (what Starlette's `TrustedHostMiddleware` does, answering in the API's
  JSON error shape and parsing IPv6 hosts): a page on evil.example whose name later
  resolves to 127.0.0.1 (DNS rebinding) sends `Host: evil.example`, and is refused.
- **Cross-site writes refused**: a state-changing request that a browser marks as coming
  from another site (`Sec-Fetch-Site`, else an `Origin` that is not this host) gets 403.
  With tokens on, a browser cannot forge the `Authorization` header anyway; without them
  (loopback only) this is what stops a web page from cancelling your jobs.
- **Body size** enforced on the stream, not only on `Content-Length`: a chunked upload is
  counted as it arrives and refused past the limit, before anything is stored.
- **Security headers** on every response; a strict Content-Security-Policy on the
  dashboard (everything it loads ships with it).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from urllib.parse import urlsplit

from fastapi import HTTPException
from starlette.datastructures import Headers, MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

_SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})

_COMMON_HEADERS = {
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    "Cross-Origin-Opener-Policy": "same-origin",
    "Cross-Origin-Resource-Policy": "same-origin",
}
# The dashboard loads only its own files; style attributes set by uPlot need inline styles.
DASHBOARD_CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; "
    "img-src 'self' data:; connect-src 'self'; object-src 'none'; base-uri 'none'; "
    "form-action 'self'; frame-ancestors 'none'"
)
API_CSP = "default-src 'none'; frame-ancestors 'none'"
# Swagger UI and ReDoc (api/routes/api_docs.py): scripts from this server only, no inline
# script; both set style attributes and inject <style> tags, and ReDoc searches in a worker
# it makes from a blob.
DOCS_CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self' 'unsafe-inline'; "
    "img-src 'self' data:; font-src 'self'; connect-src 'self'; worker-src blob:; "
    "object-src 'none'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
_DOCS_PATHS = ("/docs", "/redoc")


def host_of(header: str) -> str:
    """The host name in a Host header (or an Origin's netloc), without port or brackets."""
    header = header.strip().lower()
    if header.startswith("["):  # [::1]:8000
        return header[1 : header.find("]")] if "]" in header else header
    if header.count(":") > 1:  # a bare IPv6 address
        return header
    return header.partition(":")[0]


def host_allowed(host: str, allowed: Iterable[str]) -> bool:
    for pattern in allowed:
        if pattern == "*" or host == pattern:
            return True
        if pattern.startswith("*.") and host.endswith(pattern[1:]):
            return True
    return False


def cross_site(method: str, headers: Headers) -> bool:
    """Is this a state-changing request a browser sent from another site?"""
    if method in _SAFE_METHODS:
        return False
    fetch_site = headers.get("sec-fetch-site")
    if fetch_site is not None:
        return fetch_site not in ("same-origin", "none")
    origin = headers.get("origin")
    if origin is None or origin == "null":
        return origin == "null"  # sandboxed frames and file:// pages send "null"
    return urlsplit(origin).netloc.lower() != headers.get("host", "").lower()


async def _reject(send: Send, status: int, detail: str) -> None:
    body = json.dumps({"detail": detail}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in _COMMON_HEADERS.items()]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def _too_large(limit: int) -> str:
    return f"request body too large (limit {limit} bytes)"


class RequestGuard:
    def __init__(
        self,
        app: ASGIApp,
        *,
        allowed_hosts: list[str],
        max_body_bytes: int,
        body_limits: dict[str, int] | None = None,
    ) -> None:
        self.app = app
        self.allowed_hosts = allowed_hosts
        self.max_body_bytes = max_body_bytes
        #: Paths that take larger bodies (uploads), path -> limit in bytes.
        self.body_limits = body_limits or {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        host = host_of(headers.get("host", ""))
        if not host_allowed(host, self.allowed_hosts):
            await _reject(
                send, 400, f"host {host[:100]!r} is not served here (ELASTRAIN_ALLOWED_HOSTS)"
            )
            return
        if cross_site(scope["method"], headers):
            await _reject(send, 403, "cross-site request refused: send it from the dashboard")
            return
        limit = self.body_limits.get(scope["path"], self.max_body_bytes)
        declared = headers.get("content-length")
        if declared is not None and (
            not (declared.isascii() and declared.isdigit()) or int(declared) > limit
        ):
            await _reject(send, 413, _too_large(limit))
            return
        await self.app(scope, self._counting(receive, limit), self._with_headers(scope, send))

    def _counting(self, receive: Receive, limit: int) -> Receive:
        seen = 0

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    # Raised inside the route's body read: FastAPI passes HTTPExceptions
                    # through, so the client gets a 413 and the route never runs.
                    raise HTTPException(status_code=413, detail=_too_large(limit))
            return message

        return counted

    def _with_headers(self, scope: Scope, send: Send) -> Send:
        path: str = scope["path"]
        dashboard = path == "/" or path.startswith("/static/")
        csp = DOCS_CSP if path in _DOCS_PATHS else (DASHBOARD_CSP if dashboard else API_CSP)

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                out = MutableHeaders(scope=message)
                for name, value in _COMMON_HEADERS.items():
                    out.setdefault(name, value)
                if csp is not None:
                    out.setdefault("Content-Security-Policy", csp)
            await send(message)

        return send_with_headers
