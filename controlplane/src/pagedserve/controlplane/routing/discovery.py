"""Data-plane discovery by DNS: a headless Service name resolves to one address per pod.

The dispatcher asks a `Resolver` for the current set on every refresh; the default is the real
lookup (`resolve_dataplanes`). Tests inject their own to "scale" without a DNS server.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable

Resolver = Callable[[str], Awaitable[list[str]]]
"""`NAME:PORT` -> the `HOST:PORT` addresses it stands for now (raise OSError when unknown)."""


async def resolve_dataplanes(name_and_port: str) -> list[str]:
    """`NAME:PORT` -> sorted `IP:PORT` for every address the name resolves to (IPv6 bracketed)."""
    host, _, port = name_and_port.rpartition(":")
    infos = await asyncio.get_running_loop().getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
    addresses = set()
    for family, _, _, _, sockaddr in infos:
        ip = str(sockaddr[0])
        addresses.add(f"[{ip}]:{port}" if family == socket.AF_INET6 else f"{ip}:{port}")
    return sorted(addresses)
