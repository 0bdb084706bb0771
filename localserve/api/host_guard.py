"""DNS-rebinding and cross-site guard for the desktop default: loopback, no keys.

Such a server trusts whoever can reach it, which should be only this machine's own programs.
A web page the user visits can still reach it through the browser: by rebinding its own
domain name to 127.0.0.1 (the request then carries `Host: evil.example`), or by sending a
cross-site request (it carries `Origin: https://evil.example`). Both are refused here; tools
that talk to the server directly send a loopback Host and no Origin, and pass.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from localserve.api.limits import send_refusal
from localserve.common.net import is_loopback


def host_name(value: str) -> str:
    """'127.0.0.1:8080' -> '127.0.0.1', '[::1]:8080' -> '::1', 'Example.lan' -> 'example.lan'."""
    return (urlsplit("//" + value).hostname or "").lower()


class LoopbackHostGuard:
    """ASGI middleware: 421 for a Host that is not loopback (or --allowed-host), 403 for a
    browser Origin that is neither loopback nor a --cors-origin."""

    def __init__(self, app, allowed_hosts: tuple[str, ...] = (), cors_origins: tuple[str, ...] = ()):
        self.app = app
        self.allowed_hosts = {h.lower() for h in allowed_hosts}
        self.cors_origins = {o.rstrip("/") for o in cors_origins}

    def host_ok(self, host: str) -> bool:
        name = host_name(host)
        return is_loopback(name) or name in self.allowed_hosts

    def origin_ok(self, origin: str) -> bool:
        return (origin.rstrip("/") in self.cors_origins or self.host_ok(urlsplit(origin).netloc))

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        host = headers.get(b"host", b"").decode("latin-1")
        origin = headers.get(b"origin", b"").decode("latin-1")
        if host and not self.host_ok(host):
            return await send_refusal(send, 421, f"Host '{host}' is not this server's: a loopback server "
                                 f"without API keys answers only to loopback names (add "
                                 f"--allowed-host NAME to accept another).", "host_not_allowed")
        if origin and not self.origin_ok(origin):  # "null" (an opaque origin) is refused too
            return await send_refusal(send, 403, f"Cross-site request from '{origin}' refused: allow a "
                                 f"browser frontend with --cors-origin {origin}.", "origin_not_allowed")
        return await self.app(scope, receive, send)
