"""Binding the parts' listening sockets (webhook, metrics) before kopf starts.

A port already in use, or an address that is not this host's, is then one clear line at start
instead of a traceback from inside kopf. The socket is bound without SO_REUSEPORT and put in the
listening state at once, so a second controller given the same port is refused rather than sharing
it (with SO_REUSEPORT the kernel would split connections between the two, and the API server would
meet the other one's certificate). SO_REUSEADDR stays on: it only lets a restarted process bind
while connections of the old one linger in TIME_WAIT, never while another socket listens there.
"""

from __future__ import annotations

import errno
import socket

from mig_operator.core.requests.quantities import read_integer

BACKLOG = 128


class ListenError(ValueError):
    """An address that cannot be listened on; the message names the flag, the value and a remedy."""


def split_address(text: str) -> tuple[str, int]:
    """``HOST:PORT`` as (host, port); an empty host is every interface, ``[::1]:9443`` is IPv6."""
    host, sep, port = text.rpartition(":")
    number = read_integer(port, 1, 65535)
    if not sep or number is None:
        raise ListenError(f"address {text[:60]!r} is not HOST:PORT; use e.g. '127.0.0.1:9443' or ':9090'")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, number


def _why(exc: OSError, host: str, port: int) -> str:
    if exc.errno == errno.EADDRINUSE:
        return f"port {port} is in use by another process"
    if exc.errno == errno.EADDRNOTAVAIL:
        return f"{host or '*'} is not an address of this host"
    if exc.errno == errno.EACCES:
        return f"no permission to listen on port {port} (ports below 1024 need privileges)"
    if isinstance(exc, socket.gaierror):
        return f"host {host!r} is not known ({exc.strerror})"
    return exc.strerror or str(exc)


def listen(flag: str, text: str, example: str) -> socket.socket:
    """A TCP socket bound to ``text`` (HOST:PORT) and listening; ``flag`` and ``example`` word the error."""
    host, port = split_address(text)
    try:
        if host:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
            # A name with both kinds of address (localhost) listens on its IPv4 one.
            family, kind, proto, _, address = next((i for i in infos if i[0] == socket.AF_INET), infos[0])
        else:  # every interface: IPv4's wildcard, as the servers used before did
            family, kind, proto, address = socket.AF_INET, socket.SOCK_STREAM, 0, ("0.0.0.0", port)
        sock = socket.socket(family, kind, proto)
    except OSError as exc:
        raise ListenError(f"{flag} {text!r} cannot be listened on: {_why(exc, host, port)}; "
                          f"use e.g. {flag} {example}") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(BACKLOG)
    except OSError as exc:
        sock.close()
        raise ListenError(f"{flag} {text!r} cannot be listened on: {_why(exc, host, port)}; "
                          f"use e.g. {flag} {example}") from None
    sock.set_inheritable(False)
    return sock
