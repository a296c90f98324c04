"""Kernel socket buffer sizes for the step's bulk transfers, shared by the agent's client and
the control plane's bulk listener (both ends of a transfer must agree to get the benefit)."""

from __future__ import annotations

import socket

# 256 KiB each way (the kernel doubles it): 8 concurrent 12.9 MB transfers each way over loopback
# took 0.89-0.91x the CPU of the kernel's autotuning, the weights direction ~0.83x, and ~20% less
# wall time (bench/socket_buffers.py; 64 KiB and 1 MiB did worse); a phone's link (Wi-Fi, USB
# Ethernet) needs far less than this to keep its pipe full
DEFAULT_SOCKET_BUFFER_BYTES = 256 * 1024


def set_socket_buffers(sock: socket.socket, size: int) -> None:
    """Fixed kernel send and receive buffers of `size` bytes (0: leave the kernel's autotuning).
    Small fixed buffers keep a transfer's bytes in the CPU caches between the sender's copy into
    the kernel and the receiver's copy out of it when both ends share a machine."""
    if size > 0:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, size)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, size)
