"""The parameters each fault kind takes (``PARAMS``) and the checks a plan's entries pass
(``check_params``), apart from the plan format itself (``plan``)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

CORRUPTION_TARGETS = ("data", "manifest")

STORAGE_ERRORS = ("full", "readonly", "eio", "vanish", "flock", "stall")
"""How a storage-fail fault's saves fail (``unbroken.faults.storagefail``)."""

STALL_S = 3600.0
"""How long a storage-fail stall blocks the write by default: beyond any sane
``persist_timeout_s``, so that the Checkpointer's timeout ends it."""

MAX_WINDOW_S = 86_400.0
"""Longest a degrading fault (slow-rank, network) may last."""

# kind -> {parameter: (default, what it takes)}; kinds listed here accept no other parameter.
PARAMS: dict[str, dict[str, tuple[Any, str]]] = {
    "slow-storage": {
        "mbps": (5.0, "a number > 0 (MB/s)"),
        "saves": (3, "an integer >= 1 (saves throttled; the default unless seconds is given)"),
        "seconds": (None, "a number > 0 (seconds throttled, instead of saves)"),
        "ranks": (None, "'all' or a list of ranks (default: the fault's rank)"),
    },
    "storage-fail": {
        "error": ("full", f"one of {', '.join(STORAGE_ERRORS)}"),
        "saves": (1, "an integer >= 1 (saves of each rank that fail)"),
        "ranks": ("all", "'all' or a non-empty list of ranks (whose saves fail)"),
        "stall_s": (
            None,
            f"a number in (0, {MAX_WINDOW_S:g}] (how long a stalled write blocks; only with "
            f"error: stall, which defaults it to {STALL_S:g})",
        ),
    },
    "checkpoint-corruption": {
        "target": ("data", f"one of {', '.join(CORRUPTION_TARGETS)}"),
    },
    "node-loss": {},
    "oom-kill": {
        "limit_mb": (256, "an integer >= 1 (MB the rank may grow by)"),
    },
    "slow-rank": {
        "cpu": (0.5, "a number in (0, 1] (the share of one CPU the rank keeps)"),
        "seconds": (30.0, f"a number in (0, {MAX_WINDOW_S:g}] (how long)"),
    },
    "network": {
        "delay_ms": (50.0, "a number in [0, 10000] (ms added to each packet, each way)"),
        "loss": (1.0, "a number in [0, 100) (percent of packets dropped, each way)"),
        "seconds": (20.0, f"a number in (0, {MAX_WINDOW_S:g}] (how long)"),
        "peers": ("all", "'all' or a non-empty list of ranks (whose pods' links degrade)"),
    },
}


def names(keys: Any) -> list[str]:
    """Keys of a mapping as sorted strings (YAML keys may be of any type)."""
    return sorted(str(k) for k in keys)


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(value: Any) -> bool:
    """A finite int or float (not a bool, nan or inf)."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _param_error(where: str, name: str, value: Any, kind: str) -> ValueError:
    what = PARAMS[kind][name][1]
    return ValueError(f"{where}: {name} must be {what}, got {value!r}; fix it or leave it out")


def check_params(kind: str, params: Mapping[str, Any], *, where: str) -> None:
    """Raise ValueError naming the bad parameter of a kind listed in PARAMS."""
    if kind not in PARAMS:
        return
    allowed = PARAMS[kind]
    unknown = names(set(params) - set(allowed))
    if unknown:
        takes = ", ".join(allowed) if allowed else "no parameters"
        raise ValueError(
            f"{where}: unknown parameter(s) {unknown} for {kind}; it takes {takes}: "
            "remove or rename them"
        )
    if kind == "slow-storage":
        if "mbps" in params and not (_number(params["mbps"]) and params["mbps"] > 0):
            raise _param_error(where, "mbps", params["mbps"], kind)
        saves: Any = params.get("saves")
        if "saves" in params and not (is_int(saves) and saves >= 1):
            raise _param_error(where, "saves", saves, kind)
        if "seconds" in params and not (_number(params["seconds"]) and params["seconds"] > 0):
            raise _param_error(where, "seconds", params["seconds"], kind)
        if "saves" in params and "seconds" in params:
            raise ValueError(
                f"{where}: give saves (how many saves are slow) or seconds (for how long), not both"
            )
        _check_ranks(params, where=where, kind=kind)
    elif kind == "storage-fail":
        _check_storage_fail(params, where=where)
    elif (
        kind == "checkpoint-corruption"
        and "target" in params
        and params["target"] not in CORRUPTION_TARGETS
    ):
        raise _param_error(where, "target", params["target"], kind)
    elif kind == "oom-kill" and "limit_mb" in params:
        limit = params["limit_mb"]
        if not (is_int(limit) and 1 <= limit <= 1 << 20):
            raise _param_error(where, "limit_mb", limit, kind)
    elif kind in ("slow-rank", "network"):
        _check_degrading(kind, params, where=where)


def _check_storage_fail(params: Mapping[str, Any], *, where: str) -> None:
    """The parameters of storage-fail (see PARAMS)."""
    kind = "storage-fail"
    error = params.get("error", "full")
    if not (isinstance(error, str) and error in STORAGE_ERRORS):
        raise _param_error(where, "error", error, kind)
    saves: Any = params.get("saves")
    if "saves" in params and not (is_int(saves) and saves >= 1):
        raise _param_error(where, "saves", saves, kind)
    _check_ranks(params, where=where, kind=kind)
    if "stall_s" in params:
        stall = params["stall_s"]
        if not (_number(stall) and 0 < stall <= MAX_WINDOW_S):
            raise _param_error(where, "stall_s", stall, kind)
        if error != "stall":
            raise ValueError(
                f"{where}: stall_s applies only to error: stall (got error: {error}); "
                "remove stall_s or set error: stall"
            )


def _check_ranks(params: Mapping[str, Any], *, where: str, kind: str) -> None:
    """``ranks``, when given: "all" or a non-empty list of ranks."""
    ranks = params.get("ranks")
    if (
        "ranks" in params
        and ranks != "all"
        and not (isinstance(ranks, list) and ranks and all(is_int(r) and r >= 0 for r in ranks))
    ):
        raise _param_error(where, "ranks", ranks, kind)


def _check_degrading(kind: str, params: Mapping[str, Any], *, where: str) -> None:
    """The parameters of slow-rank and network (see PARAMS)."""
    ranges = {
        "cpu": lambda v: 0 < v <= 1,
        "seconds": lambda v: 0 < v <= MAX_WINDOW_S,
        "delay_ms": lambda v: 0 <= v <= 10_000,
        "loss": lambda v: 0 <= v < 100,
    }
    for name, ok in ranges.items():
        if name in params and not (_number(params[name]) and ok(params[name])):
            raise _param_error(where, name, params[name], kind)
    if kind != "network":
        return
    peers = params.get("peers", "all")
    if peers != "all" and not (
        isinstance(peers, list) and peers and all(is_int(r) and r >= 0 for r in peers)
    ):
        raise _param_error(where, "peers", peers, kind)
    if params.get("delay_ms", 50.0) == 0 and params.get("loss", 1.0) == 0:
        raise ValueError(
            f"{where}: delay_ms and loss are both 0: nothing would degrade; give delay_ms > 0 "
            "or loss > 0"
        )
