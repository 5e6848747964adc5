"""The weight-update group's store: an IPv4 master address gets an IPv4 listening socket, owned by the store."""

from __future__ import annotations

import datetime
import gc
import socket
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from services.trainer.weight_sync import rendezvous

TIMEOUT = datetime.timedelta(seconds=30)
LISTEN = "0A"  # /proc/net/tcp's state of a listening socket


def listening_on(port: int) -> set[str]:
    """Which of /proc/net/tcp (IPv4) and /proc/net/tcp6 hold a listening socket on `port`."""
    found = set()
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            if state == LISTEN and int(local.rsplit(":", 1)[1], 16) == port:
                found.add(table)
    return found


def test_an_ipv4_master_address_listens_on_ipv4_and_serves_workers():
    store = rendezvous.host_store("127.0.0.1", 0, 2, TIMEOUT)
    assert listening_on(store.port) == {"tcp"}
    worker = dist.TCPStore("127.0.0.1", store.port, 2, is_master=False, timeout=TIMEOUT)
    worker.set("rank1", "joined")
    assert store.get("rank1") == b"joined"
    port = store.port
    del worker, store
    gc.collect()
    deadline = time.monotonic() + 30  # the store closed the socket it was handed (on its loop's thread)
    while listening_on(port) and time.monotonic() < deadline:
        time.sleep(0.1)
    with socket.socket() as again:  # the port is free again
        again.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        again.bind(("0.0.0.0", port))


def test_a_hostname_keeps_torchs_own_socket():
    store = rendezvous.host_store("localhost", 0, 1, TIMEOUT)
    assert "tcp6" in listening_on(store.port)


def test_a_port_in_use_is_named():
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        with pytest.raises(OSError, match=f"cannot listen on port {port}"):
            rendezvous.host_store("127.0.0.1", port, 2, TIMEOUT)


@pytest.mark.parametrize("address, expected", [("127.0.0.1", True), ("10.1.2.3", True), ("::1", False),
                                               ("localhost", False), ("trainer-0.svc", False)])
def test_ipv4_literals(address, expected):
    assert rendezvous.is_ipv4_literal(address) is expected
