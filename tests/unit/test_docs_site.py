"""The documentation site: it builds in strict mode (a broken link, anchor or API reference fails
it), its generated references hold what the code has, the README stays a front door, the pages
say what is (history and hashes go to CHANGELOG.md and the benchmarks page), and every exit code
the code defines is explained on the troubleshooting page. (Commands and flags the pages show:
test_docs.py.)"""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
SRC = ROOT / "src" / "unbroken"
README_MAX_LINES = 200
HISTORY_ALLOWED = {"CHANGELOG.md", "docs/benchmarks.md"}
"""Where commit hashes and dated measurement narratives belong."""
PUBLIC_MODULES = {
    "unbroken.errors",
    "unbroken.integrations.lightning",
    "unbroken.integrations.accelerate",
    "unbroken.integrations.transformers",
}
"""Public modules documented besides the packages that declare ``__all__`` (an integration is
its own module: importing it imports its framework)."""
UNDOCUMENTED = {"unbroken.k8s.emulate"}
"""Packages with ``__all__`` that are not a user's API: the emulated cluster serves the tests
and the benchmarks (its manual: docs/kubernetes.md)."""

_HASH = re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b")
_NARRATIVE = re.compile(
    r"measured at|before this change|at the last measurement|at an earlier (?:commit|measurement)"
    r"|before the (?:rescue|fix)|sessions? ago|\bsince [0-9a-f]{7}",
    re.I,
)
_EXIT = re.compile(r"^(EXIT_[A-Z_]+)\s*(?::[^=]+)?=\s*(\d+)\s*$", re.M)


def _pages() -> dict[str, str]:
    """README.md and the site's Markdown sources, by path from the repository root."""
    pages = {"README.md": (ROOT / "README.md").read_text()}
    for path in sorted(DOCS.rglob("*.md")):
        pages[str(path.relative_to(ROOT))] = path.read_text()
    return pages


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The site, built once with ``mkdocs build --strict`` into a temporary directory."""
    out = tmp_path_factory.mktemp("site")
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    run = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet"]
        + ["--config-file", str(ROOT / "mkdocs.yml"), "--site-dir", str(out)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=240,
    )
    assert run.returncode == 0, f"mkdocs build --strict failed:\n{run.stdout}\n{run.stderr}"
    return out


@pytest.mark.slow
def test_the_site_builds_strict(site: Path) -> None:
    for page in ("index.html", "getting-started/index.html", "troubleshooting/index.html"):
        assert (site / page).is_file(), page


@pytest.mark.slow
def test_the_cli_reference_is_every_parser(site: Path) -> None:
    """The hook rendered the help of every ``unbroken`` subcommand and of ``unbroken-run``."""
    spec = importlib.util.spec_from_file_location(
        "cli_reference", DOCS / "hooks" / "cli_reference.py"
    )
    assert spec is not None and spec.loader is not None
    cli_reference = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli_reference)
    from unbroken import cli

    html = (site / "cli" / "index.html").read_text()
    assert cli_reference.MARKER not in html
    commands = [
        " ".join(path) for path, _ in cli_reference._walk(cli.build_parser(), ("unbroken",))
    ]
    assert len(commands) > 20, commands
    for command in commands:
        assert f"usage: {command}" in html, f"the CLI reference lacks `{command} --help`"
    assert "usage: unbroken-run" in html
    assert "--ft-run-dir" in html
    assert "usage: python -m unbroken.workload.train" in html or "--ckpt-every" in html


@pytest.mark.slow
def test_the_api_reference_is_generated(site: Path) -> None:
    html = (site / "api" / "unbroken" / "index.html").read_text()
    for name in ("unbroken.Checkpointer", "unbroken.run", "unbroken.RestartContext"):
        assert f'id="{name}"' in html, f"the API page lacks {name}"
    html = (site / "api" / "checkpoint" / "index.html").read_text()
    assert 'id="unbroken.checkpoint.CheckpointConfig"' in html


def _packages_with_all() -> set[str]:
    found = set()
    for init in SRC.rglob("__init__.py"):
        tree = ast.parse(init.read_text())
        for node in tree.body:
            targets = node.targets if isinstance(node, ast.Assign) else []
            if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
                parts = init.parent.relative_to(SRC.parent).parts
                found.add(".".join(parts))
    return found


def test_the_api_pages_name_public_packages_only() -> None:
    """``::: X`` names a package by its public path (one that declares ``__all__``), never a
    module inside one: internal modules move (checkpoint's did), public paths stay. And every
    such package has its page."""
    public = _packages_with_all()
    assert {"unbroken", "unbroken.checkpoint", "unbroken.restart"} <= public, public
    shown = set()
    for path in sorted(DOCS.rglob("*.md")):
        for name in re.findall(r"^:::\s*(\S+)", path.read_text(), re.M):
            assert name in public | PUBLIC_MODULES, (
                f"{path.relative_to(ROOT)} renders {name}: reference a public package "
                f"({sorted(public)}) and its __all__ instead"
            )
            shown.add(name)
    assert public - UNDOCUMENTED <= shown, f"no API page for {sorted(public - shown)}"


def test_the_readme_is_a_front_door() -> None:
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, (
        f"README.md has {len(lines)} lines (at most {README_MAX_LINES}): move the detail into "
        "a page under docs/"
    )
    links = re.findall(r"\]\((docs/[^)#]+)", "\n".join(lines))
    assert "docs/architecture.md" in links, "the README links the design inside the repository"
    for link in links:
        assert (ROOT / link).is_file(), f"README links {link}, which does not exist"


@pytest.mark.parametrize("page", [p for p in _pages() if p not in HISTORY_ALLOWED])
def test_pages_say_what_is_not_what_was(page: str) -> None:
    """No commit hashes and no "measured at <commit>" / "before this change" narratives: history
    goes to CHANGELOG.md, dated figures to docs/benchmarks.md."""
    text = _pages()[page]
    hashes = sorted(set(_HASH.findall(text)))
    assert not hashes, f"{page} names commits {hashes}: move that history to CHANGELOG.md"
    phrases = sorted({m.group(0) for m in _NARRATIVE.finditer(text)})
    assert not phrases, f"{page} tells history ({phrases}): say what is; history to CHANGELOG.md"


def test_the_history_checks_catch_history() -> None:
    assert _HASH.search("as measured at f4de04c (5 min)")
    assert not _HASH.search("a deadbeef facade and 1234567 steps")
    assert _NARRATIVE.search("0.49 s at the last measurement")
    assert not _NARRATIVE.search("the newest measurement of the run")


def _exit_codes() -> dict[str, int]:
    """Every module-level ``EXIT_*`` integer constant under src/unbroken."""
    codes: dict[str, int] = {}
    for path in sorted(SRC.rglob("*.py")):
        for name, value in _EXIT.findall(path.read_text()):
            codes[name] = int(value)
    return codes


def test_every_exit_code_is_explained() -> None:
    codes = _exit_codes()
    assert {"EXIT_CONFIG", "EXIT_USAGE", "EXIT_BUDGET_EXHAUSTED", "EXIT_ESCALATE"} <= set(codes)
    rows = [line for line in (DOCS / "troubleshooting.md").read_text().splitlines() if "|" in line]
    for name, value in codes.items():
        explained = [r for r in rows if f"`{name}`" in r and str(value) in r.split("|")[1].split()]
        assert explained, (
            f"{name} = {value} has no row (code, name, cause, what to do) in "
            "docs/troubleshooting.md"
        )
