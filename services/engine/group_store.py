"""The engine's client of the trainer's weight-update group store (torch's TCPStore wire format), for gloo groups: it
connects to the address given and never names its peer, where torch's client asks a reverse DNS lookup of the master's
address at each connect (64 engines joining at once: 64 queries). Only what a group's rendezvous needs.
"""

from __future__ import annotations

import datetime
import os
import socket
import struct
import threading
import time

import torch.distributed as dist

# torch's TCPStore protocol: a query type byte, strings and byte values as a little-endian u64 length and the bytes
VALIDATE, SET, GET, ADD, CHECK, WAIT, PING = 0, 1, 3, 4, 5, 6, 13
VALIDATION_MAGIC = 0x3C85F7CE
READY = STOP_WAITING = 0
KEY_PREFIX = "/"  # torch's client puts it before every key: the trainer's side sees the same names


def _string(value: str | bytes) -> bytes:
    data = value.encode() if isinstance(value, str) else bytes(value)
    return struct.pack("<Q", len(data)) + data


def _keys(keys: list[str]) -> bytes:
    return struct.pack("<Q", len(keys)) + b"".join(_string(KEY_PREFIX + key) for key in keys)


class GroupStoreClient(dist.Store):
    """A store client on one TCP connection to `host:port`, one query at a time. Keep it referenced while a group
    made on it lives: torch calls its methods only while the Python object exists."""

    def __init__(self, host: str, port: int, timeout: datetime.timedelta) -> None:
        super().__init__()
        self.address = f"{host}:{port}"
        self.timeout_s = timeout.total_seconds() or None  # torch's 0: no timeout
        self.lock = threading.Lock()
        self.sock = self._connect(host, port)
        nonce = os.getpid() & 0xFFFFFFFF
        self.sock.sendall(struct.pack("<BI", VALIDATE, VALIDATION_MAGIC) + struct.pack("<BI", PING, nonce))
        if struct.unpack("<I", self._read(4, self.timeout_s))[0] != nonce:
            raise dist.DistStoreError(f"weight update group store {self.address}: wrong reply to the handshake")

    def _connect(self, host: str, port: int) -> socket.socket:
        """Connect, retrying while nothing listens yet (as torch's client does), until the timeout."""
        deadline = time.monotonic() + (self.timeout_s or float("inf"))
        while True:
            try:
                sock = socket.create_connection((host, port), timeout=min(30.0, max(0.1, deadline - time.monotonic())))
                break
            except ConnectionRefusedError as err:
                if time.monotonic() >= deadline:
                    raise dist.DistStoreError(f"weight update group store {self.address}: nothing listens "
                                              f"({err})") from err
                time.sleep(0.05)
            except OSError as err:
                raise dist.DistStoreError(f"weight update group store {self.address}: {err}") from err
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock

    def _read(self, num_bytes: int, timeout_s: float | None) -> bytes:
        self.sock.settimeout(timeout_s)
        data = bytearray()
        try:
            while len(data) < num_bytes:
                chunk = self.sock.recv(num_bytes - len(data))
                if not chunk:
                    raise dist.DistStoreError(f"weight update group store {self.address}: connection closed")
                data += chunk
        except TimeoutError:
            self.sock.close()  # a reply may still come: the connection is out of step, so no query may follow
            raise
        return bytes(data)

    def _wait(self, keys: list[str], timeout_s: float | None) -> None:
        self.sock.sendall(struct.pack("<B", WAIT) + _keys(keys))
        try:
            reply = self._read(1, timeout_s)
        except TimeoutError:
            raise dist.DistStoreError(f"weight update group store {self.address}: keys {keys} not set within "
                                      f"{timeout_s:g} s") from None
        if reply[0] != STOP_WAITING:
            raise dist.DistStoreError(f"weight update group store {self.address}: unexpected wait reply {reply!r}")

    def set(self, key: str, value: str | bytes) -> None:
        with self.lock:
            self.sock.sendall(struct.pack("<B", SET) + _string(KEY_PREFIX + key) + _string(value))

    def get(self, key: str) -> bytes:
        """The key's value, once some rank set it (within the timeout)."""
        with self.lock:
            self._wait([key], self.timeout_s)
            self.sock.sendall(struct.pack("<B", GET) + _string(KEY_PREFIX + key))
            return self._read(struct.unpack("<Q", self._read(8, self.timeout_s))[0], self.timeout_s)

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        with self.lock:
            self._wait(list(keys), self.timeout_s if timeout is None else timeout.total_seconds() or None)

    def add(self, key: str, amount: int) -> int:
        with self.lock:
            self.sock.sendall(struct.pack("<B", ADD) + _string(KEY_PREFIX + key) + struct.pack("<q", amount))
            return struct.unpack("<q", self._read(8, self.timeout_s))[0]

    def check(self, keys: list[str]) -> bool:
        with self.lock:
            self.sock.sendall(struct.pack("<B", CHECK) + _keys(list(keys)))
            return self._read(1, self.timeout_s)[0] == READY

    def close(self) -> None:
        self.sock.close()
