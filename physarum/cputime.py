"""CPU seconds (user + system) used by process trees, read from /proc: how the demo and the benchmarks tell their
own work from a shared machine's other load (wall time counts both)."""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from pathlib import Path


def process_table(*, reaped_children: bool = True) -> dict[int, tuple[int, float]]:
    """Every live process: pid -> (parent pid, user + system CPU seconds, its reaped children's included unless
    `reaped_children` is false)."""
    ticks, table = os.sysconf("SC_CLK_TCK"), {}
    last = 15 if reaped_children else 13  # utime, stime[, cutime, cstime]
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            table[int(entry.name)] = (int(fields[1]), sum(int(f) for f in fields[11:last]) / ticks)
    return table


def tree_pids(table: dict[int, tuple[int, float]], roots: Iterable[int]) -> Iterator[int]:
    """The processes `roots` of `table` and all their live descendants, each once."""
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    todo, seen = [pid for pid in roots if pid in table], set()
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.add(pid)
        yield pid
        todo.extend(children.get(pid, []))


def tree_cpu_seconds(roots: Iterable[int]) -> float:
    """CPU seconds so far of the processes `roots` and all their live descendants."""
    table = process_table()
    return sum(table[pid][1] for pid in tree_pids(table, roots))
