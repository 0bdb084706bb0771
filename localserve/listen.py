"""Where the server listens: `--host` as llama-server reads it, one address or several separated
by commas, each an IP address or name, or a UNIX socket's path ending in `.sock`. Every address
is bound before "listening on" is printed, so a taken one fails the start in one line naming it
(and no client can connect to a server that is not there yet)."""

from __future__ import annotations

import contextlib
import os
import socket
import stat

from localserve.common.config import SettingsError
from localserve.common.net import is_unix_socket, listen_addresses

BACKLOG = 2048  # uvicorn's


def bind_all(host: str, port: int) -> list[socket.socket]:
    """A bound socket for each address, or SettingsError for the first that cannot be (the
    ones bound before it closed)."""
    addresses = listen_addresses(host)
    several_tcp = sum(not is_unix_socket(a) for a in addresses) > 1
    bound: list[socket.socket] = []
    try:
        for address in addresses:
            bound.append(_bind_unix(address) if is_unix_socket(address)
                         else _bind_tcp(address, port, v6_only=several_tcp))
    except BaseException:
        for sock in bound:
            sock.close()
        raise
    return bound


# The socket files this process made, by path: (device, inode, change time; an inode number
# is soon reused), so that at exit it removes its own and never a newer server's on that path.
_MADE: dict[str, tuple[int, int, int]] = {}


def remove_unix_sockets(host: str) -> None:
    """At exit: the socket files this server made leave with it (a file another server made
    at the same path since stays)."""
    for address in filter(is_unix_socket, listen_addresses(host)):
        with contextlib.suppress(OSError):
            found = os.stat(address)
            if _MADE.get(address) == (found.st_dev, found.st_ino, found.st_ctime_ns):
                os.unlink(address)


def _bind_tcp(address: str, port: int, v6_only: bool) -> socket.socket:
    """As uvicorn binds one address; beside others, `::` takes IPv6 only (as llama-server's)
    so that `0.0.0.0,::` does not bind IPv4 twice."""
    ip = address.strip("[]")
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6 and v6_only:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind((ip, port))
        sock.listen(BACKLOG)  # now: two addresses that overlap fail here, named
    except OSError as exc:
        sock.close()
        raise SettingsError(f"--host {address} --port {port}: cannot listen there "
                            f"({exc.strerror or exc}); another server is probably using it: "
                            f"choose another --port") from None
    return sock


def _bind_unix(path: str) -> socket.socket:
    _remove_stale_socket(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        umask = os.umask(0o177)  # the file is the owner's only (0600), whatever the umask
        try:
            sock.bind(path)
        finally:
            os.umask(umask)
        made = os.stat(path)
        _MADE[path] = (made.st_dev, made.st_ino, made.st_ctime_ns)
        sock.listen(BACKLOG)
    except OSError as exc:
        sock.close()
        raise SettingsError(f"--host {path}: cannot listen on that UNIX socket "
                            f"({exc.strerror or exc})") from None
    return sock


def _remove_stale_socket(path: str) -> None:
    """A socket file that a server gone without cleaning up left is removed; one a server
    still answers on, or a file that is no socket, is refused."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return  # nothing there (or not reachable: bind says why)
    if not stat.S_ISSOCK(mode):
        raise SettingsError(f"--host {path}: that file exists and is not a socket; "
                            f"choose another path")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(path)
        except ConnectionRefusedError:
            os.unlink(path)
            return
        except OSError:
            return
    raise SettingsError(f"--host {path}: another server is listening on that socket")
