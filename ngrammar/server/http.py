"""The HTTP edge: what happens before a route runs, and below it in uvicorn.

``Guard`` (pure ASGI, outermost) answers in OpenAI's error shape before the body is read: the API
key first (a bad body without a key is a 401, not a 400), then ``Content-Length`` against the body
limit (413). It also wraps ``receive``: a body that grows past the limit while it streams is a 413,
and a client that stops sending its body for ``read_timeout_s`` is a 408.

``GuardedH11Protocol`` (uvicorn's h11 protocol, subclassed) closes a connection that has not sent a
request's headers within ``header_timeout_s`` (a slow client holding a socket forever), refuses
connections past ``max_connections`` with a 503, and answers a malformed request with JSON rather
than uvicorn's plain text.

``DrainingServer`` (uvicorn's server, subclassed) bounds shutdown: the first SIGTERM or SIGINT
drains (``timeout_graceful_shutdown``) and arms an alarm that ends the process ``EXIT_DEADLINE_S``
later whatever is still running.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import signal
from types import FrameType
from typing import TYPE_CHECKING, Any

import h11
import uvicorn
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

if TYPE_CHECKING:
    from ngrammar.server.config import ServerConfig

OPEN_PATHS = frozenset({"/health"})  # reachable without the API key
_REFUSED_CLOSE_S = 0.5
DRAIN_S = 5  # in-flight requests get this long to finish after SIGTERM / SIGINT
EXIT_DEADLINE_S = 12  # then the process ends by this, drained or not


def sse(payload: bytes) -> bytes:
    """One server-sent event."""
    return b"data: " + payload + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


def error_body(message: str, type_: str, code: str | None = None) -> bytes:
    """OpenAI's error shape, ASCII-escaped (a lone surrogate in a message cannot break it)."""
    return json.dumps({"error": {"message": message, "type": type_, "param": None, "code": code}}).encode()


def _raw_response(status: int, reason: str, message: str, type_: str, code: str | None = None) -> bytes:
    body = error_body(message, type_, code)
    head = (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode() + body


class BodyTooLarge(StarletteHTTPException):
    """Raised from ``receive``; FastAPI re-raises HTTPExceptions met while reading the body."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, f"the request body is larger than the server's limit of {limit} bytes")


class BodyTimeout(StarletteHTTPException):
    def __init__(self, seconds: float) -> None:
        super().__init__(408, f"the request body did not arrive within {seconds:g} s")


class Guard:
    def __init__(self, app: ASGIApp, config: ServerConfig) -> None:
        self.app = app
        self.api_key = config.api_key
        self.max_body = config.max_body_bytes
        self.read_timeout_s = config.read_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        if self.api_key is not None and scope.get("path") not in OPEN_PATHS and not self._authorized(headers):
            await _send_error(
                send, 401, "invalid or missing API key", "authentication_error", "invalid_api_key"
            )
            return
        length = headers.get(b"content-length")
        if length is not None:
            try:
                too_large = int(length) > self.max_body
            except ValueError:
                await _send_error(
                    send, 400, "the Content-Length header is not a number", "invalid_request_error"
                )
                return
            if too_large:  # closed after the answer: the client need not send the body it announced
                message = f"the request body ({int(length)} bytes) is larger than the server's limit of "
                await _send_error(
                    send, 413, message + f"{self.max_body} bytes", "invalid_request_error", close=True
                )
                return
        started = False
        streaming = False  # an event stream whose body has not ended
        body = _BoundedBody(receive, self.max_body, self.read_timeout_s)

        async def noting(message: Message) -> None:
            nonlocal started, streaming
            if message["type"] == "http.response.start":
                started = True
                streaming = _is_event_stream(message)
                if body.cut:  # the body's unread rest must not be parsed as this connection's next request
                    message = {**message, "headers": [*message.get("headers", []), (b"connection", b"close")]}
            elif not message.get("more_body", False):
                streaming = False
            await send(message)

        try:
            await self.app(scope, body, noting)
        except asyncio.CancelledError:
            # uvicorn cancels what still runs when the shutdown drain ends: answer in OpenAI's shape
            # (503, retry; a stream's last event an error, then [DONE]) rather than its plain-text 500
            # or a cut stream, and a logged traceback.
            message = "the server is shutting down; retry the request"
            if streaming:
                event = sse(error_body(message, "service_unavailable", "shutting_down"))
                await send({"type": "http.response.body", "body": event + SSE_DONE, "more_body": False})
                return
            if started:
                raise
            await _send_error(send, 503, message, "service_unavailable", "shutting_down")

    def _authorized(self, headers: dict[bytes, bytes]) -> bool:
        assert self.api_key is not None
        scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
        return scheme.lower() == b"bearer" and secrets.compare_digest(token.strip(), self.api_key.encode())


class _BoundedBody:
    """``receive`` with the body limit and the read timeout, both until the body has ended (later
    calls wait for a disconnect, which may take as long as the response does). ``cut`` says a limit
    ended the body early: the response then closes the connection (h11 does so on ``connection:
    close``)."""

    def __init__(self, receive: Receive, max_body: int, read_timeout_s: float) -> None:
        self.receive = receive
        self.max_body = max_body
        self.read_timeout_s = read_timeout_s
        self.received = 0
        self.ended = False
        self.cut = False

    async def __call__(self) -> Message:
        if self.ended:
            return await self.receive()
        try:
            message = await asyncio.wait_for(self.receive(), self.read_timeout_s)
        except TimeoutError:
            self.cut = True
            raise BodyTimeout(self.read_timeout_s) from None
        if message["type"] == "http.request":
            self.received += len(message.get("body", b""))
            if self.received > self.max_body:
                self.cut = True
                raise BodyTooLarge(self.max_body)
            self.ended = not message.get("more_body", False)
        return message


def _is_event_stream(start: Message) -> bool:
    return any(
        k.lower() == b"content-type" and v.startswith(b"text/event-stream")
        for k, v in start.get("headers", [])
    )


async def _send_error(
    send: Send, status: int, message: str, type_: str, code: str | None = None, close: bool = False
) -> None:
    body = error_body(message, type_, code)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a header timeout, a connection cap and JSON errors."""

    header_timeout_s = 10.0  # set per server by ``protocol_class``
    max_connections = 512

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_timer: asyncio.TimerHandle | None = None
        self._refused = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.max_connections:
            self._refused = True
            message = f"the server holds its limit of {self.max_connections} connections; retry later"
            transport.write(_raw_response(503, "Service Unavailable", message, "server_overloaded"))
            # Closed a moment later, reading (and dropping) what arrives meanwhile: closing a socket
            # with unread input resets it, and the client could lose the answer.
            self.loop.call_later(_REFUSED_CLOSE_S, transport.close)
            return
        self._arm_header_timer()

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        super().data_received(data)
        self._arm_header_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        super().connection_lost(exc)

    def _waiting_for_headers(self) -> bool:
        # IDLE: no request started, or one whose headers are still arriving (h11 buffers them).
        return self.conn.their_state is h11.IDLE and not self.transport.is_closing()

    def _arm_header_timer(self) -> None:
        """A timer from the moment the connection waits for a request's headers; a request that
        got its headers disarms it. Idle keep-alive connections are uvicorn's own timer's."""
        if not self._waiting_for_headers():
            self._cancel_header_timer()
        elif self._header_timer is None:
            self._header_timer = self.loop.call_later(self.header_timeout_s, self._on_header_timeout)

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _on_header_timeout(self) -> None:
        self._header_timer = None
        if self._waiting_for_headers():
            message = f"the request's headers did not arrive within {self.header_timeout_s:g} s"
            self.transport.write(_raw_response(408, "Request Timeout", message, "invalid_request_error"))
            self.transport.close()

    def send_400_response(self, msg: str) -> None:
        self.transport.write(_raw_response(400, "Bad Request", msg, "invalid_request_error"))
        self.transport.close()


def protocol_class(config: ServerConfig) -> type[GuardedH11Protocol]:
    """A ``GuardedH11Protocol`` subclass carrying this server's limits."""
    return type(
        "ServerH11Protocol",
        (GuardedH11Protocol,),
        {"header_timeout_s": config.header_timeout_s, "max_connections": config.max_connections},
    )


def uvicorn_kwargs(config: ServerConfig) -> dict[str, Any]:
    """``uvicorn.run`` / ``uvicorn.Config`` arguments for this server's address and limits."""
    return {
        "host": config.host,
        "port": config.port,
        "http": protocol_class(config),
        "timeout_keep_alive": config.keep_alive_s,
        "timeout_graceful_shutdown": DRAIN_S,
    }


class DrainingServer(uvicorn.Server):
    """uvicorn's server whose first exit signal also arms SIGALRM: its default action ends the process
    without running Python, so a step, a compile thread or a handler that does not return cannot
    hold the exit past ``EXIT_DEADLINE_S``."""

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if not self.should_exit:
            signal.signal(signal.SIGALRM, signal.SIG_DFL)
            signal.alarm(EXIT_DEADLINE_S)
        super().handle_exit(sig, frame)
