"""Docs that cannot drift: every command the README and the documentation pages (docs/**/*.md)
show exists, answers ``--help``, and takes every flag shown with it; the reference script's flag
table is its parser; the adoption diff in the README is the diff of the committed examples, and
stays within 10 added lines. (The site's build, size and wording: test_docs_site.py.)"""

from __future__ import annotations

import argparse
import difflib
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from unbroken import cli, observe
from unbroken.launcher import args as largs
from unbroken.workload import model as wmodel
from unbroken.workload import train

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
DOCS = ROOT / "docs"
PAGES = {"README.md": README} | {
    str(p.relative_to(ROOT)): p.read_text()
    for p in sorted(DOCS.rglob("*.md"))
    if "hooks" not in p.relative_to(DOCS).parts
}
"""Every page whose commands and flags are checked: the README and the site's sources."""
REFERENCE_SCRIPT_PAGE = "docs/reference-script.md"
VENV_BIN = Path(sys.executable).parent
PROGRAMS = ("unbroken", "unbroken-run", "python", "make")
MAX_ADDED_LINES = 10
PAIRS = [
    ("plain_fsdp.py", "fsdp.py"),
    ("plain_ddp.py", "ddp.py"),
    ("plain_lightning_ddp.py", "lightning_ddp.py"),
    ("plain_accelerate.py", "accelerate_ddp.py"),
    ("plain_hf_trainer.py", "hf_trainer.py"),
    ("plain_torchtitan_llama.py", "torchtitan_llama.py"),
    ("upstream/fsdp2/plain_example.py", "upstream/fsdp2/example.py"),  # pytorch/examples' own
]

_FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)
_FLAG = re.compile(r"--[a-z][a-z0-9_-]*")
_FOREIGN = re.compile(r"`(?:kubernetes-validate|kubectl|torchrun) [^`]*`")
_TITAN = re.compile(r"--module \w+ --config \w+|`?--(?:checkpoint|training)\.[\w.*-]+`?")
"""torchtitan's own arguments (its ConfigManager's ``--module``/``--config`` and its
``--section.key`` flags), after a torchtitan script or ``-m unbroken.integrations.torchtitan``."""
_PLACEHOLDER = re.compile(r"^[A-Z][A-Z0-9_]*[.]*$|[\[\]|]|\.\.\.")


@dataclass(frozen=True)
class Command:
    page: str
    """The page that shows it (README.md, docs/....md)."""
    text: str
    """As shown (continuations joined)."""
    argv: tuple[str, ...]
    """The program and its arguments (no environment assignments, no .venv/bin/)."""
    synopsis: bool
    """A usage line with placeholders (``[--json PATH]``, ``RUN_DIR``), not a runnable one."""


def _shell_lines(block: str) -> Iterator[str]:
    """The lines of a shell block, continuations joined, here-documents skipped."""
    lines = iter(block.replace("\\\n", " ").splitlines())
    for line in lines:
        heredoc = re.search(r"<<-?'?(\w+)'?", line)
        if heredoc:
            for body in lines:
                if body.strip() == heredoc.group(1):
                    break
            continue
        yield line


def _command(page: str, text: str, *, synopsis: bool = False) -> Command | None:
    try:
        tokens = shlex.split(text, comments=True)
    except ValueError:
        return None
    while tokens and re.match(r"^[A-Z_][A-Z0-9_]*=", tokens[0]):  # VAR=value prefixes
        tokens.pop(0)
    if not tokens:
        return None
    tokens[0] = tokens[0].removeprefix(".venv/bin/")
    if tokens[0] not in PROGRAMS:
        return None
    if tokens[0] == "python" and not (tokens[1:2] == ["-m"] and tokens[2:3] != []):
        return None
    if tokens[0] == "python" and not tokens[2].startswith("unbroken"):
        return None
    synopsis = synopsis or any(_PLACEHOLDER.search(t) for t in tokens)
    return Command(page=page, text=text.strip(), argv=tuple(tokens), synopsis=synopsis)


def page_commands(page: str, text: str) -> list[Command]:
    """Commands in a page's shell blocks (lines starting at column 0) and in inline code
    (taken as usage lines)."""
    found: list[Command] = []
    for lang, block in _FENCE.findall(text):
        if lang in ("", "sh", "bash"):
            for line in _shell_lines(block):
                if line[:1].strip():
                    cmd = _command(page, line)
                    if cmd is not None:
                        found.append(cmd)
    prose = _FENCE.sub("", text)
    for span in re.findall(r"`([^`\n]+)`", prose):
        cmd = _command(page, span, synopsis=True)
        if cmd is not None:
            found.append(cmd)
    return found


COMMANDS = [cmd for page, text in PAGES.items() for cmd in page_commands(page, text)]


def _subparsers(p: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in p._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _walk(p: argparse.ArgumentParser) -> Iterator[argparse.ArgumentParser]:
    yield p
    for sub in _subparsers(p).values():
        yield from _walk(sub)


def _options(p: argparse.ArgumentParser) -> set[str]:
    return {s for a in p._actions for s in a.option_strings}


def _flags(tokens: tuple[str, ...] | list[str]) -> set[str]:
    # Only tokens that are options (``--x``, ``[--x``, ``--x=v``): a quoted argument such as
    # ``--command "-m mytrain --steps 1000"`` holds another program's flags.
    opts = [t for t in tokens if t.lstrip("[").startswith("-") and " " not in t]
    return {m for t in opts for m in _FLAG.findall(t)}


def _unbroken_path(argv: tuple[str, ...]) -> tuple[list[str], argparse.ArgumentParser, list[str]]:
    """(subcommand path, its parser, the rest) of an ``unbroken ...`` command. A synopsis may
    show a group's own options between it and its subcommand (``unbroken kb [--db DB] show``):
    those must be options of the group."""
    parser, path = cli.build_parser(), []
    rest = list(argv[1:])
    while rest and _subparsers(parser):
        subs = _subparsers(parser)
        group_opts: list[str] = []
        while rest and rest[0].startswith("["):
            opt = rest.pop(0)
            group_opts.append(opt)
            while not opt.endswith("]") and rest:
                opt = rest.pop(0)
                group_opts.append(opt)
        missing = _flags(group_opts) - _options(parser)
        assert not missing, f"`unbroken {' '.join(path)}` lacks {missing}"
        if not rest or rest[0] not in subs:
            rest = group_opts + rest
            break
        path.append(rest.pop(0))
        parser = subs[path[-1]]
    return path, parser, rest


def _check_parses(parser: argparse.ArgumentParser, args: list[str], cmd: Command) -> None:
    parser.allow_abbrev = False  # a flag shown must be spelled out as the parser has it
    try:
        parser.parse_args(args)
    except SystemExit as e:
        raise AssertionError(f"{cmd.page} shows `{cmd.text}`, which does not parse") from e


def test_the_docs_show_commands() -> None:  # the extraction itself works
    programs = {c.argv[0] for c in COMMANDS}
    assert programs == set(PROGRAMS), programs
    assert sum(not c.synopsis for c in COMMANDS) >= 5
    readme = [c for c in COMMANDS if c.page == "README.md"]
    assert {c.argv[0] for c in readme} >= {"unbroken", "unbroken-run", "make"}, readme
    pages = {c.page for c in COMMANDS}
    assert len(pages) >= 10, f"commands found only on {sorted(pages)}"


@pytest.mark.parametrize("cmd", COMMANDS, ids=lambda c: f"{c.page}: {c.text[:60]}")
def test_every_shown_command_exists_with_its_flags(cmd: Command) -> None:
    argv = cmd.argv
    if argv[0] == "make":
        targets = set(re.findall(r"^([a-z][a-z0-9_-]*):", (ROOT / "Makefile").read_text(), re.M))
        assert set(argv[1:]) <= targets, f"{cmd.page} shows `{cmd.text}`; Makefile has {targets}"
    elif argv[0] == "unbroken":
        path, parser, rest = _unbroken_path(argv)
        if _subparsers(parser) and rest:  # in a group (`unbroken bench`): a subcommand
            assert rest[0].startswith("-"), (
                f"{cmd.page} shows `{cmd.text}`: `unbroken {' '.join(path)}` has no subcommand "
                f"{rest[0]!r}; it has {sorted(_subparsers(parser))}"
            )
        own = rest[: rest.index("--")] if "--" in rest else rest  # after `--`: the script's
        missing = _flags(own) - _options(parser)
        assert not missing, (
            f"{cmd.page} shows `{cmd.text}`; `unbroken {' '.join(path)}` lacks {missing}"
        )
        if not cmd.synopsis:
            _check_parses(parser, rest, cmd)
    elif argv[0] == "unbroken-run":
        options = _options(largs.build_parser())
        shown = {f for f in _flags(argv[1:]) if not f.endswith("-")}  # `--ft-*` is a family
        if cmd.synopsis:
            assert not shown - options, f"{cmd.page} shows `{cmd.text}`; unbroken-run lacks those"
            return
        spec, _, _ = largs.parse(list(argv[1:]))
        own = argv[1 : argv.index(spec.entry.target)]  # before the script: unbroken-run's
        assert not _flags(own) - options, f"{cmd.page} shows `{cmd.text}`; unbroken-run lacks those"
        if spec.entry.kind == "module" and spec.entry.target == "unbroken.workload.train":
            _check_parses(train.build_parser(), list(spec.entry.args), cmd)
        elif spec.entry.kind == "script":
            assert (ROOT / spec.entry.target).is_file(), f"`{cmd.text}`: no {spec.entry.target}"
    else:  # python -m unbroken...
        module = __import__(argv[2], fromlist=["_"])
        assert hasattr(module, "build_parser"), f"`{cmd.text}`: {argv[2]} has no build_parser"
        parser = module.build_parser()
        missing = _flags(argv[3:]) - _options(parser)
        assert not missing, f"{cmd.page} shows `{cmd.text}`; {argv[2]} lacks {missing}"
        if not cmd.synopsis:
            _check_parses(parser, list(argv[3:]), cmd)


def _help_invocations() -> list[tuple[str, ...]]:
    """Each distinct program (and ``unbroken`` subcommand) the README and the pages show."""
    seen: dict[tuple[str, ...], None] = {}
    for cmd in COMMANDS:
        if cmd.argv[0] == "unbroken":
            path, _, _ = _unbroken_path(cmd.argv)
            for i in range(len(path) + 1):
                seen[("unbroken", *path[:i])] = None
        elif cmd.argv[0] == "unbroken-run":
            seen[("unbroken-run",)] = None
        elif cmd.argv[0] == "python":
            seen[("python", "-m", cmd.argv[2])] = None
    return list(seen)


@pytest.mark.parametrize("prog", _help_invocations(), ids=" ".join)
@pytest.mark.slow
def test_every_shown_program_answers_help(
    prog: tuple[str, ...], capsys: pytest.CaptureFixture[str]
) -> None:
    """Programs run as installed; ``unbroken``'s subcommands through its entry point here."""
    if prog[0] == "unbroken" and len(prog) > 1:
        with pytest.raises(SystemExit) as exit_:
            cli.main([*prog[1:], "--help"])
        out, code = capsys.readouterr().out, exit_.value.code
    else:
        exe = [sys.executable] if prog[0] == "python" else [str(VENV_BIN / prog[0])]
        run = subprocess.run(
            [*exe, *prog[1:], "--help"], capture_output=True, text=True, timeout=120
        )
        out, code = run.stdout + run.stderr, run.returncode
    assert code == 0 and "usage:" in out, out


@pytest.mark.parametrize("page", list(PAGES))
def test_every_flag_shown_exists_somewhere(page: str) -> None:
    """Flags in prose (``--steps 2000``) too: each is an option of one of our parsers."""
    parsers = [
        *_walk(cli.build_parser()),
        largs.build_parser(),
        train.build_parser(),
        observe.build_parser(),
    ]
    known = set().union(*(_options(p) for p in parsers))
    text = _FENCE.sub(
        lambda m: "" if m.group(1) in ("diff", "python", "yaml") else m.group(0), PAGES[page]
    )
    text = _FOREIGN.sub("", text)  # other programs' commands, in code spans
    text = _TITAN.sub("", text)
    shown = {f for f in _FLAG.findall(text) if not f.endswith("-")}
    assert not shown - known, f"{page} shows flags no command has: {sorted(shown - known)}"


def test_the_reference_script_flag_table_is_its_parser() -> None:
    rows = [line for line in PAGES[REFERENCE_SCRIPT_PAGE].splitlines() if line.startswith("| `--")]
    assert rows, f"{REFERENCE_SCRIPT_PAGE} has no flag table"
    shown: dict[str, list[str] | None] = {}
    for row in rows:
        for span in re.findall(r"`([^`]+)`", row.split(" | ")[0]):
            flag, _, value = span.partition(" ")
            shown[flag] = value.split("\\|") if "\\|" in value else None
    parser = train.build_parser()
    actions = {s: a for a in parser._actions for s in a.option_strings if s.startswith("--")}
    del actions["--help"]
    assert set(shown) == set(actions), (
        f"table only: {sorted(set(shown) - set(actions))}; "
        f"parser only: {sorted(set(actions) - set(shown))}"
    )
    for flag, choices in shown.items():
        real = actions[flag].choices or (list(wmodel.SIZES) if flag == "--model" else None)
        if choices is not None or real is not None:
            assert choices == list(real or []), f"{flag}: table {choices}, parser {real}"


def _diff(plain: str, adopted: str) -> str:
    a = (ROOT / "examples" / plain).read_text().splitlines(keepends=True)
    b = (ROOT / "examples" / adopted).read_text().splitlines(keepends=True)
    return "".join(difflib.unified_diff(a, b, f"examples/{plain}", f"examples/{adopted}"))


@pytest.mark.parametrize(("plain", "adopted"), PAIRS)
def test_adopting_unbroken_takes_at_most_10_lines(plain: str, adopted: str) -> None:
    """Lines the adoption adds: new ones, not the plain script's own moved into a block, and
    not the optional named phases (``with ctx.phase(...)``: they name parts of the loop for
    the report, the watchdog and fault plans; adoption works without them)."""
    lines = _diff(plain, adopted).splitlines()
    removed = {line[1:].strip() for line in lines if line.startswith("-") and line[1:].strip()}
    added = [
        line
        for line in lines
        if line.startswith("+")
        and not line.startswith("+++")
        and line[1:].strip()
        and line[1:].strip() not in removed
        and not line[1:].strip().startswith("with ctx.phase(")
    ]
    assert 0 < len(added) <= MAX_ADDED_LINES, "\n".join(added)


def test_the_readme_shows_the_diff_of_the_examples() -> None:
    expected = "```diff\n" + _diff(*PAIRS[0]) + "```"
    assert expected in README, f"update the README's adoption diff to:\n{expected}"


@pytest.mark.parametrize(
    ("plain", "adopted"),
    [
        ("plain_lightning_ddp.py", "lightning_ddp.py"),
        ("plain_accelerate.py", "accelerate_ddp.py"),
        ("plain_hf_trainer.py", "hf_trainer.py"),
        ("plain_torchtitan_llama.py", "torchtitan_llama.py"),
    ],
)
def test_the_frameworks_page_shows_the_diff_of_each_example(plain: str, adopted: str) -> None:
    expected = "```diff\n" + _diff(plain, adopted) + "```"
    page = (DOCS / "frameworks.md").read_text()
    assert expected in page, f"update docs/frameworks.md's adoption diff to:\n{expected}"
