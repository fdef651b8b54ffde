"""MkDocs hook: the CLI reference, rendered from the argparse parsers at build time.

``docs/cli.md`` holds the marker below; this hook replaces it with the ``--help`` of every
``unbroken`` subcommand (walked from ``unbroken.cli.build_parser``), of ``unbroken-run``
(``unbroken.launcher.args.build_parser``) and of the modules run with ``python -m``. So the
reference is the parsers themselves and cannot drift from them; a parser that fails to build
fails the (strict) build.
"""

from __future__ import annotations

import argparse
import importlib
import os
from collections.abc import Iterator
from typing import Any

MARKER = "<!-- cli-reference -->"
WIDTH = "80"
"""Columns argparse wraps the help to (it reads COLUMNS): the same on every machine, and
narrow enough for the page's content column."""

MODULES = ("unbroken.workload.train", "unbroken.observe")
"""Modules documented as ``python -m MODULE``: each has a ``build_parser()``."""


def _subparsers(p: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in p._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _walk(
    p: argparse.ArgumentParser, path: tuple[str, ...]
) -> Iterator[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    yield path, p
    for name, sub in _subparsers(p).items():
        yield from _walk(sub, (*path, name))


def _help(parser: argparse.ArgumentParser) -> str:
    return f"```text\n{parser.format_help().rstrip()}\n```\n"


def render() -> str:
    """The generated Markdown: a heading and a help block per command, subcommands nested."""
    from unbroken import cli
    from unbroken.launcher import args as largs

    out: list[str] = []
    for path, parser in _walk(cli.build_parser(), ("unbroken",)):
        out.append(f"{'#' * min(len(path) + 1, 4)} {' '.join(path)}\n\n{_help(parser)}")
    out.append(f"## unbroken-run\n\n{_help(largs.build_parser())}")
    for module in MODULES:
        parser = importlib.import_module(module).build_parser()
        out.append(f"## python -m {module}\n\n{_help(parser)}")
    return "\n".join(out)


def on_page_markdown(markdown: str, *, page: Any, config: Any, files: Any) -> str:
    """MkDocs event: fill the marker of the page that has it."""
    if MARKER not in markdown:
        return markdown
    saved = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = WIDTH
    try:
        return markdown.replace(MARKER, render())
    finally:
        if saved is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = saved
