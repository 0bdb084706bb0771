"""ASGI middleware around every request: read every POST body as JSON whatever its content type
(but a browser's form or text/plain body, refused as cross-site request forgery),
refuse bodies over a size limit with 413 without reading them into memory, and give back a
request's quota hold when its response ends."""

from __future__ import annotations

import json


# The body types a web page may POST elsewhere without a CORS preflight (a <form>, or fetch
# with mode "no-cors"): the Fetch standard's CORS-safelisted request Content-Types.
SIMPLE_BODY_TYPES = (b"text/plain", b"application/x-www-form-urlencoded", b"multipart/form-data")
# Headers every browser adds to a POST (the Fetch standard: Origin on every non-GET request,
# Sec-Fetch-* in every current engine) and tools such as curl, LiteLLM or Ollama's clients don't.
BROWSER_MARKS = (b"origin", b"sec-fetch-site", b"sec-fetch-mode")


class JsonBodyByDefault:
    """ASGI middleware: every POST body is read as JSON, whatever its content type says, as
    Ollama (gin's ShouldBindJSON) and llama-server do: `curl -d` sends a form type, LiteLLM's
    async transport application/octet-stream. Every route takes JSON; a body that is not
    JSON still gets the 400 that says so.

    Except a browser's "simple request": a page on another site can POST a form or text/plain
    body, or one with no Content-Type at all (fetch's no-cors Blob), without a preflight, so reading it as JSON would let any page the user visits drive a
    keyless server (cross-site request forgery). A POST that carries a browser's marks and a
    safelisted type is refused with 415 before any work; a page of a --cors-origin sends JSON
    with fetch, which the preflight covers."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["method"] == "POST":
            kind = _media_type(scope["headers"])
            if (kind in SIMPLE_BODY_TYPES or not kind) and _from_a_browser(scope["headers"]):
                return await _refuse_simple_body(send, kind.decode("latin-1") or "untyped")
            headers = [(k, v) for k, v in scope["headers"] if k != b"content-type"]
            scope = {**scope, "headers": headers + [(b"content-type", b"application/json")]}
        return await self.app(scope, receive, send)


def _media_type(headers) -> bytes:
    """'Text/Plain; charset=utf-8' -> b'text/plain'; b'' when there is none."""
    value = next((v for k, v in headers if k == b"content-type"), b"")
    return value.split(b";", 1)[0].strip().lower()


def _from_a_browser(headers) -> bool:
    return any(k in BROWSER_MARKS for k, _ in headers)


async def _refuse_simple_body(send, kind: str) -> None:
    await send_refusal(send, 415, f"A browser's {kind} body is refused (a page on another site "
                       f"can send one without asking: cross-site request forgery). Send the JSON "
                       f"body with Content-Type: application/json.", "unsupported_media_type")


async def send_refusal(send, status: int, message: str, code: str) -> None:
    """An OpenAI-shaped error answered by a middleware, before any route."""
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error",
                                 "param": None, "code": code}}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


class BodySizeLimit:
    """ASGI middleware: checks Content-Length up front and counts chunked bodies as they arrive."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return await self._refuse(send)
        seen = 0
        refused = False

        async def counting_receive():
            """Past the limit: answer 413 ourselves and tell the app the client left."""
            nonlocal seen, refused
            if refused:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    refused = True
                    await self._refuse(send)
                    return {"type": "http.disconnect"}
            return message

        async def guarded_send(message):
            if not refused:  # the app's own reply to the cut-off body is dropped
                await send(message)

        await self.app(scope, counting_receive, guarded_send)

    async def _refuse(self, send):
        await send_refusal(send, 413, f"Request body is larger than the server's limit of "
                           f"{self.max_bytes} bytes (--max-body-bytes).", "request_too_large")


# Statuses of a request turned away for its body before any work: not counted by
# requests_per_minute (a client fixing its request must not be locked out by its mistakes).
REFUSED = (400, 404, 413, 422)


class ReleaseReservations:
    """A request's hold on its key's quotas (quotas.Reservation, set by admission.hold_quota
    as request.state.quota_hold) ends when its response has been sent, streamed or not, or the
    client went away: whatever way the app returns."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        status = None

        async def noting_send(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, noting_send)
        finally:
            hold = scope.get("state", {}).get("quota_hold")
            if hold is not None:
                hold.release(refused=status in REFUSED)
