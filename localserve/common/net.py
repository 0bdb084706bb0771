"""Which addresses are this machine's own (loopback): the server's start-up checks, the RPC
worker and the loopback Host guard (api/host_guard.py) ask the same question. And `--host` as
llama-server reads it: addresses separated by commas, each an IP address or name, or a UNIX
socket's path ending in `.sock` (listen.py binds them)."""

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


def lan_address() -> str | None:
    """This machine's address on its local network (the one colleagues type), or None: the
    source address of the default route, found without sending anything."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("10.255.255.255", 1))  # UDP: no packet leaves
            address = probe.getsockname()[0]
        except OSError:
            return None
    return None if is_loopback(address) else address


def listen_addresses(host: str) -> list[str]:
    return list(dict.fromkeys(a.strip() for a in host.split(",") if a.strip())) or [host]


def is_unix_socket(address: str) -> bool:
    return address.endswith(".sock")


def local_only(host: str) -> bool:
    """Only this machine can connect: every address loopback or a UNIX socket (whose file's
    permissions decide who may)."""
    return all(is_unix_socket(a) or is_loopback(a) for a in listen_addresses(host))
