"""Router addresses by name: the one rule workers (--router) and clients (Client) share.

A DNS name stands for every router it resolves to: its A records if it has any (so
that `localhost` is one router, not two), else its AAAA records, sorted.
"""

from __future__ import annotations

import ipaddress
import socket


def is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def join_host_port(host: str, port: int | str) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def lookup(host: str, port: int) -> list[str]:
    """Every address of `host` (the rule above). Raises OSError when it does not resolve."""
    try:
        infos = socket.getaddrinfo(host, port, socket.AF_INET, socket.SOCK_STREAM)
    except socket.gaierror:
        infos = socket.getaddrinfo(host, port, socket.AF_INET6, socket.SOCK_STREAM)
    return sorted({str(info[4][0]) for info in infos})
