"""The weight-update group's TCPStore, hosted by the trainer (rank 0) on a socket it opens itself.

torch's store otherwise listens on a dual-stack IPv6 socket, so every engine's connection arrives from a v4-mapped
address (::ffff:a.b.c.d), and the store names each peer with a reverse lookup (getnameinfo) on its one event-loop
thread, one after another. /etc/hosts names 127.0.0.1 but not its mapped form, so on loopback each lookup goes to
the DNS server; where it drops some of a burst (64 engines joining at once), glibc waits its 5 s timeout. An IPv4
socket for an IPv4 master address makes the peers plain IPv4 addresses, which /etc/hosts answers where it names them.
"""

from __future__ import annotations

import datetime
import ipaddress
import socket

import torch.distributed as dist


def is_ipv4_literal(address: str) -> bool:
    try:
        return isinstance(ipaddress.ip_address(address), ipaddress.IPv4Address)
    except ValueError:
        return False


def host_store(master_address: str, master_port: int, world_size: int,
               timeout: datetime.timedelta) -> dist.TCPStore:
    """The master TCPStore on master_port (0: any free port), not waiting for the workers. For an IPv4 master
    address it listens on an IPv4 socket on every interface (torch's own listens on every interface too); for a
    hostname or an IPv6 address, torch's default socket."""
    if not is_ipv4_literal(master_address):
        return dist.TCPStore(master_address, master_port, world_size, is_master=True, timeout=timeout,
                             wait_for_workers=False)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("0.0.0.0", master_port))
        sock.listen(max(world_size, socket.SOMAXCONN))
    except OSError as err:
        sock.close()
        raise OSError(f"weight update group store: cannot listen on port {master_port}: {err}") from err
    port = sock.getsockname()[1]
    # the store owns the socket from here (it closes it when destroyed, or when its constructor fails)
    return dist.TCPStore(master_address, port, world_size, is_master=True, timeout=timeout, wait_for_workers=False,
                         master_listen_fd=sock.detach())
