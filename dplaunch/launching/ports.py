"""Rendezvous ports: detect a busy one before launch instead of failing inside 16 ranks."""

from __future__ import annotations

import socket


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    """True when nothing listens on (host, port) and we could bind it."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host if host not in ("localhost",) else "127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A port the kernel says is free now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
