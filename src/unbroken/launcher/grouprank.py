"""Group ranks that stay: a node keeps its place across rounds (``stable_ranks``).

torch's rendezvous numbers the nodes of each round by sorting their names, so a hot spare that
takes a lost node's place can move every other node, and with it its workers' global ranks
(and their shards of the model). Numbered here instead, the surviving nodes keep theirs: a
handover (``unbroken.launcher.handover``) needs a worker's rank to stay, and a worker that
restores its own rank's snapshot needs no other node's.

Imports of ours: none.
"""

from __future__ import annotations


def stable_ranks(was: list[int]) -> list[int]:
    """Group ranks for a round: a node keeps the one it had while it is free, the others take
    the free ones in torch's order (a hot spare takes the lost node's place).

    Args:
        was: For each node in torch's order, its group rank in the previous round (-1: none).

    Returns:
        For each node in torch's order, its group rank in this round.
    """
    n = len(was)
    ours = [-1] * n
    taken: set[int] = set()
    for i, r in enumerate(was):
        if 0 <= r < n and r not in taken:
            ours[i] = r
            taken.add(r)
    free = iter(r for r in range(n) if r not in taken)
    return [r if r >= 0 else next(free) for r in ours]
