"""Raw sockets as a client sees them."""

from __future__ import annotations

import socket


def closed(sock: socket.socket, wait: float = 0.01) -> bool:
    """Whether the server closed `sock`: an end of stream or a reset within `wait` seconds."""
    sock.settimeout(wait)
    try:
        return sock.recv(1) == b""
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True
