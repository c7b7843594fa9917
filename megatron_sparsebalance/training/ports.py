"""A free local port for a rendezvous store. Standard library only: the test launches that spawn
interpreters import it without megatron-core."""
from __future__ import annotations

import random
import socket

# Ports are drawn from this many just below the ephemeral range (20480-32767 with Linux's default
# range): the kernel never hands them out on its own, and one a service holds fails the bind check.
DRAW_WINDOW = 12288


def _ephemeral_ports_start() -> int:
    """The first port of the range the kernel hands out to unbound sockets (Linux; 32768 elsewhere)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A local TCP port that is free now, for a rendezvous store that listens on it a few seconds later.

    Taken below the ephemeral range: a port from ``bind(0)`` lies inside it, where the kernel also
    picks the local ports of outgoing connections, and gloo opens many of them; one took such a
    port between this check and the store's listen (EADDRINUSE in a test launch while other
    launches ran). Drawn by the system's randomness, so as not to touch the seeded ``random``.
    """
    end = _ephemeral_ports_start()
    low = max(1024, end - DRAW_WINDOW)
    pick = random.SystemRandom()
    draws = [pick.randrange(low, end) for _ in range(64)] if end - low >= 1024 else []
    for port in draws:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:  # taken: draw again
                continue
            return port
    with socket.socket() as s:  # every draw taken (or no room below the range): any free port
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
