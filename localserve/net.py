"""Which addresses are this machine's own (loopback): the server's start-up checks, the RPC
worker and the loopback Host guard (api/host_guard.py) ask the same question."""

from __future__ import annotations

import ipaddress

LOOPBACK_NAMES = {"localhost", "localhost.localdomain", "ip6-localhost"}


def is_loopback(host: str) -> bool:
    host = host.strip("[]").lower()
    if host in LOOPBACK_NAMES or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
