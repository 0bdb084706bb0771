"""ASGI middleware around every request: read every POST body as JSON whatever its content type,
refuse bodies over a size limit with 413 without reading them into memory, and give back a
request's quota hold when its response ends."""

from __future__ import annotations

import json


class JsonBodyByDefault:
    """ASGI middleware: every POST body is read as JSON, whatever its content type says, as
    Ollama (gin's ShouldBindJSON) and llama-server do: `curl -d` sends a form type, LiteLLM's
    async transport application/octet-stream. Every route takes JSON; a body that is not
    JSON still gets the 400 that says so. A browser page elsewhere can send such bodies without
    a preflight: the loopback guard (host_guard.py) and the key check stand in front, as for
    any other request."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["method"] == "POST":
            headers = [(k, v) for k, v in scope["headers"] if k != b"content-type"]
            scope = {**scope, "headers": headers + [(b"content-type", b"application/json")]}
        return await self.app(scope, receive, send)


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
        body = json.dumps({"error": {
            "message": f"Request body is larger than the server's limit of {self.max_bytes} bytes "
                       f"(--max-body-bytes).", "type": "invalid_request_error", "param": None,
            "code": "request_too_large"}}).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


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
