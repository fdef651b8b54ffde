"""Node loss: every process of the "node" dies of SIGKILL at once.

The node is the launcher agent that started this worker and every process below it: under
``unbroken-run``, the agent (its pid comes in ``UNBROKEN_AGENT_PID``, handed down by the
caller), its warm pool (zygote), every worker and each worker's checkpoint writer; under plain
torchrun, the torchrun agent (this worker's parent) and its children. Without a launcher, only
this process and its descendants die.

Order: the agent is stopped (SIGSTOP) first, so that it cannot react or start anything while the
process tree is read; the caller records the fault (flushed) once the victims are known; then
the agent, the other processes and this one get SIGKILL.
"""

from __future__ import annotations

import contextlib
import os
import signal
from dataclasses import dataclass, field
from pathlib import Path

from unbroken import env as uenv

# Parent command lines recognised as a launcher agent when no agent pid is handed down.
_AGENT_MARKERS = (
    "torchrun",
    "torch.distributed.run",
    "torch.distributed.launch",
    "unbroken-run",
    "unbroken.launcher",
)


@dataclass
class Node:
    """Who dies."""

    scope: str
    """"agent": a launcher agent and its tree; "process": only this process and its tree."""
    agent_pid: int | None
    """The agent's pid ("agent" scope)."""
    how: str
    """How the agent was found: "env" (pid handed down), "parent" (the parent's command line)."""
    pids: list[int] = field(default_factory=list)
    """Every process to kill but this one, the agent first."""


def _process_table() -> dict[int, int]:
    """pid -> ppid of every live process (zombies excluded)."""
    table = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] != "Z":
            table[int(stat.parent.name)] = int(fields[1])
    return table


def _ancestors(pid: int, table: dict[int, int]) -> list[int]:
    out: list[int] = []
    while pid in table and table[pid] not in (0, pid) and len(out) < 256:
        pid = table[pid]
        out.append(pid)
    return out


def _descendants(root: int, table: dict[int, int]) -> list[int]:
    children: dict[int, list[int]] = {}
    for pid, ppid in table.items():
        children.setdefault(ppid, []).append(pid)
    out: list[int] = []
    todo = [root]
    while todo:
        for child in sorted(children.get(todo.pop(), [])):
            out.append(child)
            todo.append(child)
    return out


def _cmdline(pid: int) -> str:
    try:
        return (
            Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        )
    except OSError:
        return ""


def find_node(agent_pid: int | None) -> Node:
    """The agent of this worker and how it was found; SIGSTOPs it and lists its tree."""
    me = os.getpid()
    table = _process_table()
    ancestors = _ancestors(me, table)
    agent, how = None, ""
    if agent_pid is not None and agent_pid in ancestors and agent_pid != 1:
        agent, how = agent_pid, "env"
    elif uenv.lookup(uenv.RUN_ID) and ancestors and ancestors[0] != 1:  # under some agent
        parent = ancestors[0]
        if any(marker in _cmdline(parent) for marker in _AGENT_MARKERS):
            agent, how = parent, "parent"
    if agent is None:
        return Node(scope="process", agent_pid=None, how="", pids=_descendants(me, table))
    with contextlib.suppress(ProcessLookupError):
        os.kill(agent, signal.SIGSTOP)
    table = _process_table()  # again: nothing new can start below a stopped agent
    pids = [agent] + [p for p in _descendants(agent, table) if p != me]
    return Node(scope="agent", agent_pid=agent, how=how, pids=pids)


def lose(node: Node) -> None:
    """SIGKILL every process of ``node``, then this one. Does not return."""
    for pid in node.pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)
