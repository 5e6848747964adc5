"""CPU seconds (user + system) used by process trees, read from /proc: how the demo and the benchmarks tell their
own work from a shared machine's other load (wall time counts both)."""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path


def process_table() -> dict[int, tuple[int, float]]:
    """Every live process: pid -> (parent pid, user + system CPU seconds, reaped children's included)."""
    ticks, table = os.sysconf("SC_CLK_TCK"), {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            table[int(entry.name)] = (int(fields[1]), sum(int(f) for f in fields[11:15]) / ticks)
    return table


def tree_cpu_seconds(roots: Iterable[int]) -> float:
    """CPU seconds so far of the processes `roots` and all their live descendants."""
    table = process_table()
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    todo, seen, total = [pid for pid in roots if pid in table], set(), 0.0
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.add(pid)
        total += table[pid][1]
        todo.extend(children.get(pid, []))
    return total
