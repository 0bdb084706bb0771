"""Images that chats name by address, fetched where the admin allows it (--image-urls), before
the chat is tokenized. The server reaches out on a client's word, so (hardening round 7):

- only to public addresses: every address the name resolves to, and the peer it connected to,
  must be global (no loopback, private, link-local, shared, multicast or reserved address),
  on every redirect hop (at most MAX_REDIRECTS), unless the admin named the host
  (--image-url-hosts: an office's own image server);
- within one wall-clock deadline per image (FETCH_DEADLINE_S: name lookup, connection, headers,
  redirects and body together) and MAX_IMAGE_BYTES;
- on the event loop, never on the thread pool that tokenizes colleagues' chats, at most
  FETCHES_PER_KEY at once per key;
- and every refusal says the same, so the server is no scanner of what answers where.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket

from localserve.api.images import MAX_IMAGE_BYTES, ImageRef
from localserve.api.key_turns import KeyTurns
from localserve.api.schemas import OpenAIError

FETCH_DEADLINE_S = 10.0
MAX_REDIRECTS = 3
FETCHES_PER_KEY = 2
_fetching = KeyTurns(FETCHES_PER_KEY)


class _Refused(Exception):
    """Not fetched: the address, the answer, the size or the time (never said which)."""


async def fetch_images(refs: list[ImageRef], allowed_hosts: tuple[str, ...],
                       key: str | None) -> list[ImageRef]:
    """The refs with every address replaced by the bytes found there, or a 400 naming the
    first that could not be fetched."""
    return [await _fetch(ref, allowed_hosts, key) if ref.url else ref for ref in refs]


async def _fetch(ref: ImageRef, allowed_hosts: tuple[str, ...], key: str | None) -> ImageRef:
    import httpx  # only where the admin allows fetching (--image-urls)

    async with _fetching.turn(key):
        try:
            async with asyncio.timeout(FETCH_DEADLINE_S):
                raw = await _get(ref.url, {h.lower() for h in allowed_hosts})
        except (_Refused, TimeoutError, OSError, httpx.HTTPError, ValueError):
            raise OpenAIError(400, f"{ref.where}: no image could be fetched from that address "
                              f"(public addresses only, an image of at most "
                              f"{MAX_IMAGE_BYTES >> 20} MB within {FETCH_DEADLINE_S:.0f} s); "
                              f"send the image itself as a data URI", param=ref.where) from None
    return ImageRef("", ref.where, raw=raw)


async def _get(url: str, allowed: set[str]) -> bytes:
    import httpx

    async with httpx.AsyncClient(follow_redirects=False, headers={"accept": "image/*"},
                                 trust_env=False) as client:
        for _ in range(MAX_REDIRECTS + 1):
            target = httpx.URL(url)
            if target.scheme not in ("http", "https") or not target.host:
                raise _Refused
            trusted = target.host.lower() in allowed
            if not trusted:
                await _check_public(target.host, target.port or (443 if target.scheme == "https"
                                                                 else 80))
            async with client.stream("GET", target) as response:
                if not trusted:
                    _check_peer(response)
                if response.is_redirect:
                    url = str(target.join(response.headers.get("location", "")))
                    continue
                if response.status_code != 200:
                    raise _Refused
                body = bytearray()
                async for piece in response.aiter_bytes():
                    body += piece
                    if len(body) > MAX_IMAGE_BYTES:
                        raise _Refused
                return bytes(body)
    raise _Refused  # too many redirects


async def _check_public(host: str, port: int) -> None:
    found = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    if not found or not all(is_public(info[4][0]) for info in found):
        raise _Refused


def _check_peer(response) -> None:
    """The address the connection reached (a name may resolve anew between the check and
    the connection)."""
    stream = response.extensions.get("network_stream")
    peer = stream.get_extra_info("server_addr") if stream is not None else None
    if not peer or not is_public(peer[0]):
        raise _Refused


def is_public(address: str) -> bool:
    """A global unicast address (an IPv4 address inside IPv6 judged as itself)."""
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_global and not ip.is_multicast
