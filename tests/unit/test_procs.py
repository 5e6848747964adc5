"""free_port: distinct ports for callers that pick several before anything binds them."""

from __future__ import annotations

from services.common import procs


def test_free_port_never_repeats_a_port_it_handed_out(monkeypatch):
    """The OS may offer the same port again while nothing has bound it yet; free_port skips it."""
    import socket as socket_module

    offers = iter([41001, 41001, 41002])

    class FakeSocket:
        def __init__(self, *args):
            self.port = next(offers)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def bind(self, address):
            pass

        def getsockname(self):
            return ("127.0.0.1", self.port)

    monkeypatch.setattr(socket_module, "socket", FakeSocket)
    monkeypatch.setattr(procs, "_RECENT_PORTS", type(procs._RECENT_PORTS)(maxlen=16))  # none handed out before
    assert [procs.free_port(), procs.free_port()] == [41001, 41002]
