"""The layering the package docstrings state, checked on the real import graph of src/unbroken.

``RULES`` is the rule, as data: for each package (or module with a rule of its own), what else
of ours it may import. A module may always import within its own package. The graph is every
``import`` statement of every module (module level, function-local, under ``TYPE_CHECKING``),
read with ``ast``; ``from unbroken.x import y`` is an arrow to ``unbroken.x.y`` when ``y`` is a
module, else to ``unbroken.x``. Each package's docstring states its rule in one sentence,
"Imports of ours: ``unbroken.a``, ``unbroken.b``." (or "none."), and a test holds the two
equal, so the docs cannot drift from what is enforced.
"""

from __future__ import annotations

import ast
import re
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"
ROOT = "unbroken"

_LIBRARY = [
    "errors",
    "version",
    "env",
    "log",
    "ledger",
    "checkpoint",
    "faults",
    "restart",
    "launcher",
]

# package (relative to unbroken; "unbroken" is the top-level module) -> what it may import
RULES: dict[str, tuple[str, ...]] = {
    "unbroken": (
        "errors",
        "version",
        "env",
        "ledger",
        "checkpoint",
        "restart",
        "launcher.client",
        "job",
    ),
    "job": ("errors", "env", "log", "ledger", "checkpoint", "faults", "restart", "launcher.client"),
    "observe": ("errors", "env", "ledger", "faults", "launcher.client"),
    "integrations": ("checkpoint", "restart"),
    # ``python -m unbroken.integrations.torchtitan``: an entry point, as a training script is
    "integrations.torchtitan.__main__": ("job", "integrations.torchtitan"),
    "errors": (),
    "mask": (),
    "version": (),
    "env": (),
    "log": (),
    "ports": (),
    "ledger": ("mask",),
    "checkpoint": ("errors", "env", "log", "ledger", "mask"),
    # checkpoint/ by lifecycle: each phase imports the ones below it, never one above
    "checkpoint.state": ("ledger", "checkpoint.config"),
    "checkpoint.staging": ("checkpoint.layout", "checkpoint.state"),
    "checkpoint.persisting": (
        "log",
        "ledger",
        "mask",
        "checkpoint.config",
        "checkpoint.layout",
        "checkpoint.staging.arena",
    ),
    "checkpoint.tiers": (
        "ledger",
        "checkpoint.config",
        "checkpoint.layout",
        "checkpoint.staging",
        "checkpoint.state",
    ),
    "checkpoint.restoring": (
        "ledger",
        "checkpoint.config",
        "checkpoint.layout",
        "checkpoint.state",
    ),
    "checkpoint.schedule": (
        "ledger",
        "checkpoint.config",
        "checkpoint.node",
        "checkpoint.persisting.inflight",
    ),
    "faults": ("errors", "env", "ledger", "checkpoint.layout"),
    "restart": ("errors", "env", "ledger", "mask"),
    "launcher": (
        "errors",
        "version",
        "env",
        "log",
        "ledger",
        "checkpoint.tiers.peers",
        "dashboard.metrics",
        "doctor",
    ),
    "launcher.client": ("env",),
    "workload": ("unbroken", "errors", "env", "log", "ledger", "checkpoint", "faults", "restart"),
    "dashboard": ("version", "ledger", "kb"),
    "kb": ("env", "ledger"),
    "k8s": ("launcher", "ports"),
    "plan": ("ledger",),
    "bench": ("unbroken", *_LIBRARY, "workload", "dashboard", "kb", "k8s"),
    "doctor": ("env", "ports", "checkpoint", "faults", "k8s"),
    "cli": ("unbroken", *_LIBRARY, "workload", "bench", "dashboard", "kb", "k8s", "plan", "doctor"),
}

# Whose docstring is not the place for the rule, and why.
DOCSTRING_EXEMPT = {"cli": "its docstring is the `unbroken --help` description"}


@dataclass(frozen=True)
class Arrow:
    source: str
    """The importing module, dotted (unbroken.ledger.goodput)."""
    target: str
    """The imported module or package, dotted."""
    line: int


def modules(src_root: Path) -> dict[str, Path]:
    """Every module under ``src_root/unbroken``, by dotted name (a package by its own name)."""
    out = {}
    for path in sorted((src_root / ROOT).rglob("*.py")):
        parts = path.relative_to(src_root).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _package_of(name: str, path: Path) -> str:
    """The package a module's relative imports are relative to."""
    return name if path.name == "__init__.py" else name.rpartition(".")[0]


def import_graph(src_root: Path) -> list[Arrow]:
    """Every arrow from a module of ours to another module of ours."""
    mods = modules(src_root)
    arrows = []
    for name, path in mods.items():
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    pkg = _package_of(name, path).split(".")
                    pkg = pkg[: len(pkg) - (node.level - 1)]
                    base = ".".join(pkg + ([base] if base else []))
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    targets.append(sub if sub in mods else base)
            for target in targets:
                if target == ROOT or target.startswith(ROOT + "."):
                    arrows.append(Arrow(name, target, node.lineno))
    return arrows


def _rel(dotted: str) -> str:
    return ROOT if dotted == ROOT else dotted.removeprefix(ROOT + ".")


def _within(name: str, key: str) -> bool:
    if key == ROOT:  # the top-level module is only itself, not everything below it
        return name == ROOT
    return name == key or name.startswith(key + ".")


def owner(module: str, rules: dict[str, tuple[str, ...]]) -> str | None:
    """The most specific rule key covering ``module`` (dotted), or None."""
    rel = _rel(module)
    keys = [k for k in rules if _within(rel, k)]
    return max(keys, key=len) if keys else None


def violations(arrows: list[Arrow], rules: dict[str, tuple[str, ...]]) -> list[str]:
    """One line per arrow the rules forbid, and per module no rule covers."""
    out = []
    for a in arrows:
        key = owner(a.source, rules)
        if key is None:
            out.append(
                f"{a.source}: no layering rule covers it; add its package to RULES in "
                f"{Path(__file__).name} and state it in its docstring"
            )
            continue
        target = _rel(a.target)
        if _within(target, key) or any(_within(target, allowed) for allowed in rules[key]):
            continue
        out.append(
            f"{a.source}:{a.line} imports {a.target}, which the rule of "
            f"{ROOT if key == ROOT else ROOT + '.' + key} forbids (it may import: "
            f"{', '.join(rules[key]) or 'nothing of ours'})"
        )
    return sorted(set(out))


def test_the_real_import_graph_keeps_the_layering() -> None:
    arrows = import_graph(SRC)
    assert len(arrows) > 100  # the walk sees the real graph (function-local imports too)
    assert violations(arrows, RULES) == []


def test_every_module_is_covered_by_a_rule() -> None:
    uncovered = [m for m in modules(SRC) if owner(m, RULES) is None]
    assert uncovered == []


_STATED = re.compile(r"Imports of ours:\s*(.*?)(?:\n\s*\n|\Z)", re.S)


def stated_rule(path: Path) -> tuple[str, ...] | None:
    """What a module's docstring says it may import (``Imports of ours: ...``), or None."""
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    m = _STATED.search(doc)
    if m is None:
        return None
    names = re.findall(r"``(unbroken(?:\.[a-z0-9_]+)*)``", m.group(1))
    return tuple(_rel(n) for n in names)


@pytest.mark.parametrize("key", sorted(set(RULES) - set(DOCSTRING_EXEMPT)))
def test_each_docstring_states_its_rule(key: str) -> None:
    mods = modules(SRC)
    path = mods[ROOT if key == ROOT else f"{ROOT}.{key}"]
    stated = stated_rule(path)
    assert stated is not None, f"{path}: the docstring has no 'Imports of ours: ...' sentence"
    assert sorted(stated) == sorted(RULES[key]), f"{path}: the docstring and RULES disagree"


# --- checkpoint/: phases by lifecycle, shared modules at the top, no private names across ------
CHECKPOINT = f"{ROOT}.checkpoint"
CHECKPOINT_SHARED = ("config", "layout", "node")
"""The modules at the top of ``unbroken.checkpoint`` that every phase may read."""


def test_every_checkpoint_subpackage_has_a_rule_of_its_own() -> None:
    subpackages = sorted(p.parent.name for p in (SRC / ROOT / "checkpoint").glob("*/__init__.py"))
    assert subpackages == ["persisting", "restoring", "schedule", "staging", "state", "tiers"]
    assert [s for s in subpackages if f"checkpoint.{s}" not in RULES] == []


def test_the_checkpoint_shared_modules_import_no_phase() -> None:
    """``config``, ``layout`` and ``node`` import nothing else of the package, and only the
    package's ``__init__`` imports ``checkpointer`` (the top of both flows; ``save``, the body
    of its ``save``/``snapshot``/``note``, names its type)."""
    shared = {f"{CHECKPOINT}.{m}" for m in CHECKPOINT_SHARED}
    found = [
        f"{a.source}:{a.line} imports {a.target}"
        for a in import_graph(SRC)
        if _within(a.source, CHECKPOINT)
        and a.source != a.target
        and (
            (a.source in shared and _within(a.target, CHECKPOINT))
            or (
                a.target == f"{CHECKPOINT}.checkpointer"
                and a.source not in (CHECKPOINT, f"{CHECKPOINT}.save")
            )
        )
    ]
    assert found == []


def test_the_checkpoint_subpackage_inits_import_nothing() -> None:
    """The writer process (``python -m unbroken.checkpoint.persisting.writer``) and fault
    injection import these packages first: they must not pull torch in before it wants it."""
    mods = modules(SRC)
    heavy = [
        name
        for name, path in mods.items()
        if _within(name, CHECKPOINT)
        and path.name == "__init__.py"
        and name != CHECKPOINT
        and any(
            isinstance(node, (ast.Import, ast.ImportFrom))
            for node in ast.walk(ast.parse(path.read_text()))
        )
    ]
    assert heavy == []


def private_imports(src_root: Path, package: str) -> list[str]:
    """Private names (``_x``) of one module of ours used by another, where either is in
    ``package`` (dotted): ``from unbroken.a import _x``, and ``a._x`` where ``a`` is a module
    of ours bound by an import."""
    mods = modules(src_root)
    out = []
    for name, path in mods.items():
        tree = ast.parse(path.read_text())
        bound: dict[str, str] = {}  # local name -> module of ours
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.asname and alias.name in mods:
                        bound[alias.asname] = alias.name
            elif isinstance(node, ast.ImportFrom) and not node.level:
                base = node.module or ""
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    if sub in mods:
                        bound[alias.asname or alias.name] = sub
                    elif (
                        base in mods
                        and base != name
                        and alias.name.startswith("_")
                        and not alias.name.startswith("__")
                        and (_within(name, package) or _within(base, package))
                    ):
                        out.append(f"{name}:{node.lineno} imports {base}.{alias.name}")
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in bound
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
            ):
                target = bound[node.value.id]
                if target != name and (_within(name, package) or _within(target, package)):
                    out.append(f"{name}:{node.lineno} uses {target}.{node.attr}")
    return sorted(set(out))


@pytest.mark.slow
def test_no_private_name_crosses_a_module_boundary_in_checkpoint() -> None:
    assert private_imports(SRC, CHECKPOINT) == []


def test_the_private_import_check_finds_both_kinds(tmp_path: Path) -> None:
    src = _tree(
        tmp_path,
        {
            "unbroken/__init__.py": "",
            "unbroken/checkpoint/__init__.py": "",
            "unbroken/checkpoint/state/__init__.py": "",
            "unbroken/checkpoint/state/resolve.py": "def _local(t):\n    return t\n_cache = {}\n",
            "unbroken/checkpoint/staging/__init__.py": "",
            "unbroken/checkpoint/staging/memory.py": """\
                from unbroken.checkpoint.state import resolve
                from unbroken.checkpoint.state.resolve import _local
                def f(t):
                    return resolve._cache, resolve.__name__, _local(t)
            """,
            "unbroken/ledger/__init__.py": "_own = 1\nprint(_own)\n",
            "unbroken/ledger/x.py": "from unbroken.ledger import _own\n",  # not checkpoint's
        },
    )
    assert private_imports(src, CHECKPOINT) == [
        "unbroken.checkpoint.staging.memory:2 imports unbroken.checkpoint.state.resolve._local",
        "unbroken.checkpoint.staging.memory:4 uses unbroken.checkpoint.state.resolve._cache",
    ]


# --- the checker itself fails on a climbing import --------------------------------------------
def _tree(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return root


def test_the_checker_fails_on_an_import_that_climbs(tmp_path: Path) -> None:
    src = _tree(
        tmp_path,
        {
            "unbroken/__init__.py": "",
            "unbroken/ledger/__init__.py": "from unbroken.ledger import math\n",
            "unbroken/ledger/math.py": """\
                from typing import TYPE_CHECKING
                if TYPE_CHECKING:
                    from unbroken import launcher
                def f():
                    from unbroken.launcher.agent import Agent
                    return Agent
            """,
            "unbroken/launcher/__init__.py": "",
            "unbroken/launcher/agent.py": "from unbroken.ledger import math\nAgent = 1\n",
            "unbroken/launcher/client.py": "from . import agent\n",
            "unbroken/newpkg/__init__.py": "from unbroken import ledger\n",
        },
    )
    found = violations(import_graph(src), RULES)
    assert found == [
        "unbroken.launcher.client:1 imports unbroken.launcher.agent, which the rule of "
        "unbroken.launcher.client forbids (it may import: env)",
        "unbroken.ledger.math:3 imports unbroken.launcher, which the rule of unbroken.ledger "
        "forbids (it may import: mask)",
        "unbroken.ledger.math:5 imports unbroken.launcher.agent, which the rule of "
        "unbroken.ledger forbids (it may import: mask)",
        "unbroken.newpkg: no layering rule covers it; add its package to RULES in "
        "test_layering.py and state it in its docstring",
    ]  # launcher -> ledger and ledger -> ledger are allowed: not listed


def test_the_docstring_check_reads_the_stated_rule(tmp_path: Path) -> None:
    path = tmp_path / "m.py"
    path.write_text('"""Owns x.\n\nImports of ours: ``unbroken.env``,\n``unbroken.ledger``.\n"""\n')
    assert stated_rule(path) == ("env", "ledger")
    path.write_text('"""Owns x. Imports of ours: none."""\n')
    assert stated_rule(path) == ()
    path.write_text('"""Owns x."""\n')
    assert stated_rule(path) is None


# --- the environment is read in one place ------------------------------------------------------
# Modules that touch os.environ to build or install a child process's environment (not to read
# configuration), and why.
ENV_BUILDERS = {
    "unbroken.launcher.cli": "the workers' base environment (torchrun's OMP_NUM_THREADS default)",
    "unbroken.launcher.bootstrap": "installs a worker's environment in the forked child",
    "unbroken.launcher.forked": "installs the warm pool's environment in the forked child",
    "unbroken.launcher.workers": "a worker's environment (TORCH_NCCL_ASYNC_ERROR_HANDLING)",
    "unbroken.bench.orchestrator": "the emulated pods' environment (this process's, or given)",
    "unbroken.restart.handover": "a worker handed over takes its next round's environment",
}


def environ_reads(src_root: Path) -> list[str]:
    """``os.environ``/``os.getenv`` uses outside ``unbroken.env``, except ``dict(os.environ,
    ...)`` copies (a child's environment being built) and the ENV_BUILDERS."""
    out = []
    for name, path in modules(src_root).items():
        if name == f"{ROOT}.env" or name in ENV_BUILDERS:
            continue
        tree = ast.parse(path.read_text())
        copies = {
            id(node.args[0])
            for node in ast.walk(tree)
            if isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "dict"
            and node.args
        }
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and node.attr in ("environ", "getenv", "environb")
                and isinstance(node.value, ast.Name)
                and node.value.id == "os"
                and id(node) not in copies
            ):
                out.append(
                    f"{name}:{node.lineno} reads os.{node.attr}; read it through unbroken.env"
                )
    return out


def test_only_unbroken_env_reads_the_environment() -> None:
    assert environ_reads(SRC) == []


def test_the_environment_check_finds_a_read(tmp_path: Path) -> None:
    src = _tree(
        tmp_path,
        {
            "unbroken/__init__.py": "",
            "unbroken/checkpoint/persisting/writer.py": """\
                import os
                child = dict(os.environ, X="1")
                PAUSE = os.environ.get("UNBROKEN_CKPT_TEST_PAUSE", "")
            """,
        },
    )
    assert environ_reads(src) == [
        "unbroken.checkpoint.persisting.writer:3 reads os.environ; read it through unbroken.env"
    ]


# --- files that read in one sitting -------------------------------------------------------------
MAX_LINES = 500


def test_no_source_file_is_over_500_lines() -> None:
    long = {
        str(p.relative_to(SRC)): n
        for p in modules(SRC).values()
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert long == {}, f"split these along their concepts: {long}"


# --- benchmarks and the workload use public names only ------------------------------------------
API_USERS = ("bench", "workload", "cli")
"""Packages that use unbroken as its users do: no private attribute of another object, no
private name imported from another module of ours."""


def private_uses(src_root: Path) -> list[str]:
    out = []
    for name, path in modules(src_root).items():
        if owner(name, RULES) not in API_USERS:
            continue
        tree = ast.parse(path.read_text())
        third_party = {
            alias.asname or alias.name.split(".")[0]
            for node in ast.walk(tree)
            if isinstance(node, (ast.Import, ast.ImportFrom))
            and not (isinstance(node, ast.ImportFrom) and (node.module or "").startswith(ROOT))
            for alias in node.names
            if not alias.name.startswith(ROOT)
        }
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(ROOT):
                for alias in node.names:
                    if alias.name.startswith("_") and not alias.name.startswith("__"):
                        out.append(f"{name}:{node.lineno} imports private {alias.name}")
            if not (
                isinstance(node, ast.Attribute)
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
            ):
                continue
            base = node.value
            if isinstance(base, ast.Name) and base.id in ("self", "cls"):
                continue
            root = base
            while isinstance(root, ast.Attribute):
                root = root.value
            if isinstance(root, ast.Name) and root.id in third_party:
                continue  # torch's, the standard library's: not ours to police here
            out.append(f"{name}:{node.lineno} reads private attribute {node.attr}")
    return out


def test_benchmarks_and_the_workload_use_public_names_only() -> None:
    assert private_uses(SRC) == []


def test_the_private_use_check_finds_one(tmp_path: Path) -> None:
    src = _tree(
        tmp_path,
        {
            "unbroken/__init__.py": "",
            "unbroken/bench/__init__.py": "",
            "unbroken/bench/checkpoint.py": """\
                import os
                from unbroken.checkpoint.state.resolve import _local
                class Saver:
                    def take(self):
                        os._exit(0)
                        return self.ck._arena.size
            """,
        },
    )
    assert private_uses(src) == [
        "unbroken.bench.checkpoint:2 imports private _local",
        "unbroken.bench.checkpoint:6 reads private attribute _arena",
    ]


def test_the_reference_script_assembles_no_layer_by_hand() -> None:
    """The reference script (and the workload modules it uses) adopts unbroken as any script
    does: through ``unbroken`` (and ``unbroken.checkpoint``'s exported names), never a module
    of the launcher, the checkpoint package, in-process restart, fault injection or
    ``unbroken.job`` itself; what it needs that the API lacked, ``unbroken.run`` provides."""
    internals = ("launcher", "checkpoint.", "restart", "faults", "job")
    found = []
    for arrow in import_graph(SRC):
        if not arrow.source.startswith(f"{ROOT}.workload"):
            continue
        target = _rel(arrow.target)
        if any(
            target == i or target.startswith(i if i.endswith(".") else i + ".") for i in internals
        ):
            found.append(f"{arrow.source}:{arrow.line} imports {arrow.target}")
    assert found == []
