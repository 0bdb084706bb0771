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


# `--cors-origin localhost` (llama-server's shorthand): any loopback origin, on any port.
LOOPBACK_ORIGIN = r"https?://(localhost|127(\.\d{1,3}){3}|\[::1\])(:\d{1,5})?"


def cors_rules(origins: tuple[str, ...]) -> dict:
    """CORSMiddleware's origin options for the --cors-origin values."""
    named = [o for o in origins if o != "localhost"]
    loopback = len(named) < len(origins)
    return {"allow_origins": named, "allow_origin_regex": LOOPBACK_ORIGIN if loopback else None}


class LoggedCORS(CORSMiddleware):
    def preflight_response(self, request_headers):
        response = super().preflight_response(request_headers)
        if response.status_code != 200:
            log.warning("refused a CORS preflight from origin %r (%s); allowed origins: %s",
                        request_headers.get("origin"), response.body.decode(errors="replace"),
                        ", ".join(self.allow_origins) or "none"
                        + (" and any loopback origin" if self.allow_origin_regex else ""))
        return response
