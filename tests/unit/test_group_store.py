"""The engine's client of the weight-update group store, against the trainer's real torch TCPStore: each query, a
gloo group joined through it, and an engine's join that asks the resolver no reverse lookup (traced with strace)."""

from __future__ import annotations

import datetime
import shutil
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from services.engine.group_store import GroupStoreClient
from services.trainer.weight_sync import rendezvous
from services.trainer.weight_sync.weight_sync import init_custom_process_group

TIMEOUT = datetime.timedelta(seconds=30)
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def master() -> dist.TCPStore:
    return rendezvous.host_store("127.0.0.1", 0, 3, TIMEOUT)


def test_each_query_meets_the_trainers_store(master):
    client = GroupStoreClient("127.0.0.1", master.port, TIMEOUT)
    client.set("from-engine", b"\x00\x01bytes")
    assert master.get("from-engine") == b"\x00\x01bytes"
    master.set("from-trainer", "text")
    assert client.get("from-trainer") == b"text"
    assert client.add("count", 3) == 3
    assert master.add("count", 4) == 7
    assert client.check(["from-engine", "from-trainer"]) is True
    assert client.check(["from-engine", "missing"]) is False
    client.wait(["from-engine", "from-trainer"])


def test_get_waits_for_a_key_set_later(master):
    client = GroupStoreClient("127.0.0.1", master.port, TIMEOUT)
    setter = threading.Timer(0.3, lambda: master.set("late", "here"))
    setter.start()
    assert client.get("late") == b"here"
    setter.join()


def test_a_key_never_set_is_named_at_the_timeout(master):
    client = GroupStoreClient("127.0.0.1", master.port, TIMEOUT)
    with pytest.raises(dist.DistStoreError, match=r"keys \['never'\] not set within 0.2 s"):
        client.wait(["never"], datetime.timedelta(seconds=0.2))


def test_nothing_listening_is_named():
    with socket.socket() as bound:  # bound, never listening: connections to it are refused
        bound.bind(("127.0.0.1", 0))
        port = bound.getsockname()[1]
        with pytest.raises(dist.DistStoreError, match=f"127.0.0.1:{port}: nothing listens"):
            GroupStoreClient("127.0.0.1", port, datetime.timedelta(seconds=0.3))


def test_a_gloo_group_joins_through_it_and_broadcasts(master):
    received: dict[int, torch.Tensor] = {}
    errors: list[BaseException] = []

    def engine(rank: int) -> None:
        try:
            store = GroupStoreClient("127.0.0.1", master.port, TIMEOUT)
            prefixed = dist.PrefixStore("cpu/", dist.PrefixStore("sync/", dist.PrefixStore("sync", store)))
            group = dist.ProcessGroupGloo(prefixed, rank, 3, TIMEOUT)
            tensor = torch.zeros(5)
            group.broadcast([tensor], dist.BroadcastOptions()).wait()
            received[rank] = tensor
        except BaseException as err:  # noqa: BLE001 - reported by the test below
            errors.append(err)

    threads = [threading.Thread(target=engine, args=(rank,)) for rank in (1, 2)]
    for thread in threads:
        thread.start()
    group = init_custom_process_group(master, backend="gloo", world_size=3, rank=0, group_name="sync", timeout=TIMEOUT)
    group.broadcast([torch.arange(5.0)], dist.BroadcastOptions()).wait()
    for thread in threads:
        thread.join(60)
    assert not errors
    assert all(torch.equal(received[rank], torch.arange(5.0)) for rank in (1, 2))
    dist.destroy_process_group(group)


@pytest.mark.parametrize("init_method", ["tcp://::1:29500", "tcp://[::1:29500", "env://", "tcp://trainer",
                                         "tcp://:29500"])
def test_an_engines_join_names_a_bad_init_method(init_method):
    from services.common.errors import InvalidArgument
    from services.engine.weights import init_custom_process_group as engine_join

    with pytest.raises(InvalidArgument, match="init_method must be tcp://HOST:PORT"):
        engine_join(backend="gloo", init_method=init_method, world_size=2, rank=1, group_name="bad", timeout=TIMEOUT)


JOIN = """
import datetime, sys
from services.engine.weights import init_custom_process_group
group, store = init_custom_process_group(backend="gloo", init_method=sys.argv[1], world_size=2, rank=1,
                                         group_name="traced", timeout=datetime.timedelta(seconds=60))
"""
TORCH_CLIENT = """
import datetime, sys
import torch.distributed as dist
host, port = sys.argv[1].removeprefix("tcp://").rsplit(":", 1)
dist.TCPStore(host, int(port), None, is_master=False, timeout=datetime.timedelta(seconds=60)).set("x", "y")
"""


def traced_reverse_lookups(code: str, init_method: str, tmp_path: Path, name: str) -> int:
    """How many reverse DNS queries (in-addr.arpa, ip6.arpa) the process running `code` sent, under strace."""
    trace = tmp_path / f"{name}.trace"
    subprocess.run(["strace", "-f", "-qq", "-s", "512", "-e", "trace=sendto,sendmsg,sendmmsg,write", "-o", str(trace),
                    sys.executable, "-c", code, init_method], cwd=ROOT, check=True, timeout=120,
                   capture_output=True)
    return sum("arpa" in line for line in trace.read_text(errors="replace").splitlines())


def test_an_engines_join_asks_no_reverse_lookup(master, tmp_path):
    if shutil.which("strace") is None or subprocess.run(["strace", "-o", "/dev/null", "true"],
                                                        capture_output=True).returncode != 0:
        pytest.skip("strace is missing or cannot trace here: the join's DNS queries cannot be seen")
    init_method = f"tcp://127.0.0.1:{master.port}"
    # the control: torch's own client names the master's address, and on this host that is a DNS query
    if traced_reverse_lookups(TORCH_CLIENT, init_method, tmp_path, "torch") == 0:
        pytest.skip("this host answers the reverse lookup of ::ffff:127.0.0.1 without a DNS query (nscd, or no "
                    "dns in nsswitch.conf): a join that asks one would not be seen either")
    joined: list[dist.ProcessGroup] = []
    trainer = threading.Thread(target=lambda: joined.append(init_custom_process_group(
        master, backend="gloo", world_size=2, rank=0, group_name="traced", timeout=TIMEOUT)))
    trainer.start()
    assert traced_reverse_lookups(JOIN, init_method, tmp_path, "engine") == 0
    trainer.join(60)
    assert joined
    dist.destroy_process_group(joined[0])
