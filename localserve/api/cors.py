"""CORS for browser frontends, with the refusals said out loud.

A refused preflight is otherwise silent on the server and shows only as "Failed to fetch" in
the browser; the usual causes are a trailing slash or localhost vs 127.0.0.1, so the log
names the origin and the configured list, and start-up warns about trailing slashes.
"""

from __future__ import annotations

import logging

from starlette.middleware.cors import CORSMiddleware

log = logging.getLogger("localserve")


def origin_warnings(origins: tuple[str, ...]) -> list[str]:
    """What is probably a mistake in --cors-origin values (an origin never ends with '/')."""
    return [f"--cors-origin {o!r} ends with '/': browsers send origins without it, so it will "
            f"never match; use {o.rstrip('/')!r}" for o in origins if o.endswith("/")]


class LoggedCORS(CORSMiddleware):
    def preflight_response(self, request_headers):
        response = super().preflight_response(request_headers)
        if response.status_code != 200:
            log.warning("refused a CORS preflight from origin %r (%s); allowed origins: %s",
                        request_headers.get("origin"), response.body.decode(errors="replace"),
                        ", ".join(self.allow_origins) or "none")
        return response
