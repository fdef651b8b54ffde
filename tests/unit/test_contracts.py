"""The public API states its contracts, and src/ states no history.

Public: every name in ``__all__`` of a package whose ``__init__`` declares one (``PACKAGES``),
and the public methods of those classes. Each documents, in Google style as mkdocstrings
renders it (a section opens after a blank line; an entry is ``name: text``, its continuation
lines indented deeper):

- ``Args:`` naming every parameter (``self``/``cls``, ``*args``/``**kwargs`` optional), and no
  name the signature does not have; a class documents its ``__init__``'s in its own docstring or
  its ``__init__``'s; a dataclass field may instead carry its own docstring (an attribute
  docstring, which mkdocstrings renders);
- ``Returns:`` (or ``Yields:``) when the annotated return is not None (properties excepted);
- ``Raises:`` naming every exception class the function's own body raises (``raise X(...)``).

And no file under src/ holds a commit-hash-like token, a "before this change" narrative or a
benchmark figure (a decimal percentage, an "N x faster"): those belong in git, CHANGELOG.md and
the docs' benchmarks page, next to the command that measures them.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import io
import re
import textwrap
import tokenize
import typing
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"

PACKAGES = (
    "unbroken",
    "unbroken.checkpoint",
    "unbroken.doctor",
    "unbroken.faults",
    "unbroken.integrations.torchtitan",
    "unbroken.k8s.emulate",
    "unbroken.kb",
    "unbroken.launcher",
    "unbroken.ledger",
    "unbroken.plan",
    "unbroken.restart",
)
"""Every package whose ``__init__`` declares ``__all__`` (a test holds this list to src/)."""

SECTIONS = (
    "Args",
    "Arguments",
    "Attributes",
    "Example",
    "Examples",
    "Note",
    "Notes",
    "Params",
    "Parameters",
    "Raises",
    "Returns",
    "Warning",
    "Warnings",
    "Yields",
)
_ARGS = {"Args", "Arguments", "Params", "Parameters"}
_HEADER = re.compile(rf"^(\s*)({'|'.join(SECTIONS)}):\s*$")
_ARG = re.compile(r"^(\*{0,2}\w+)\s*(?:\([^)]*\))?:(?:\s|$)")
_RAISE = re.compile(r"^([A-Za-z_][\w.]*):\s+\S")
_NAMED = re.compile(r"^(?:\w+\s*)?(?:\([^)]*\))?:")
"""A Returns/Yields entry mkdocstrings reads as ``name (type): text``."""


# --- a Google-style docstring, read as mkdocstrings reads it ---------------------------------


@dataclasses.dataclass
class Doc:
    sections: dict[str, list[str]]
    """Section title -> the first line of each of its entries."""
    problems: list[str]
    """What mkdocstrings would warn about or misread."""

    def names(self, titles: set[str], pattern: re.Pattern[str]) -> list[str]:
        out = []
        for title in titles & self.sections.keys():
            for entry in self.sections[title]:
                m = pattern.match(entry)
                if m is None:
                    self.problems.append(f"{title}: entry {entry!r} is not 'name: text'")
                else:
                    out.append(m.group(1))
        return out


def parse(doc: str) -> Doc:
    lines = inspect.cleandoc(doc).splitlines()
    out = Doc({}, [])
    i = 0
    while i < len(lines):
        m = _HEADER.match(lines[i])
        if m is None:
            i += 1
            continue
        indent, title = len(m.group(1)), m.group(2)
        if i > 0 and lines[i - 1].strip():
            out.problems.append(f"no blank line above {title}: (not read as a section)")
        i += 1
        entries: list[str] = []
        item_indent: int | None = None
        while i < len(lines):
            line = lines[i]
            if not line.strip():
                i += 1
                continue
            depth = len(line) - len(line.lstrip())
            if depth <= indent:
                break
            if item_indent is None:
                item_indent = depth
            if depth == item_indent:
                entries.append(line.strip())
            elif depth < item_indent:
                out.problems.append(f"{title}: {line.strip()!r} is indented less than its entry")
            i += 1
        if title in out.sections:
            out.problems.append(f"two {title}: sections")
        out.sections.setdefault(title, []).extend(entries)
    return out


# --- the public names --------------------------------------------------------------------------


def public_objects() -> Iterator[tuple[str, Any]]:
    """(qualified name, object) of every public function and class, each once."""
    seen: set[int] = set()
    for pkg in PACKAGES:
        module = importlib.import_module(pkg)
        for name in module.__all__:
            obj = getattr(module, name)
            if not (inspect.isclass(obj) or inspect.isfunction(obj)) or id(obj) in seen:
                continue  # modules, constants, instances: documented where they are defined
            seen.add(id(obj))
            yield f"{obj.__module__}.{obj.__qualname__}", obj


def _own_doc(obj: Any) -> str | None:
    return obj.__doc__ if isinstance(obj.__doc__, str) and obj.__doc__.strip() else None


def _field_docs(cls: type) -> set[str]:
    """Names of fields with an attribute docstring in ``cls`` or its bases."""
    out: set[str] = set()
    for klass in cls.__mro__:
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError):
            continue
        body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
        for a, b in zip(body, body[1:], strict=False):
            doc = isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant)
            if isinstance(a, ast.AnnAssign) and isinstance(a.target, ast.Name) and doc:
                out.add(a.target.id)
    return out


def _method_doc(cls: type, name: str) -> str | None:
    """The method's own docstring, else that of the method it overrides (a ``Protocol``'s)."""
    for klass in cls.__mro__[:-1]:
        member = vars(klass).get(name)
        fn = member.__func__ if isinstance(member, staticmethod | classmethod) else member
        if fn is not None and (doc := _own_doc(fn)):
            return doc
    return None


def _raised(fn: Callable[..., Any]) -> set[str]:
    """Exception classes that the body of ``fn`` raises by name (nested functions aside)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError):
        return set()
    top = tree.body[0]
    out: set[str] = set()
    stack: list[ast.AST] = list(ast.iter_child_nodes(top))
    while stack:
        node = stack.pop()
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda | ast.ClassDef):
            continue
        if isinstance(node, ast.Raise) and node.exc is not None:
            exc = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
            name = exc.attr if isinstance(exc, ast.Attribute) else getattr(exc, "id", "")
            if name[:1].isupper():  # a class, not ``raise err`` of a caught one
                out.add(name)
        stack.extend(ast.iter_child_nodes(node))
    return out


def _returns_value(sig: inspect.Signature) -> bool:
    ann = sig.return_annotation
    if ann is inspect.Signature.empty or ann is None:
        return False
    text = ann if isinstance(ann, str) else getattr(ann, "__name__", repr(ann))
    return text not in ("None", "NoReturn", "Never") and not text.endswith("[None]")


def check_function(
    where: str,
    fn: Callable[..., Any],
    doc: str | None,
    *,
    returns: bool = True,
) -> list[str]:
    """What ``doc`` misses of the contract of ``fn``."""
    sig = inspect.signature(fn)
    params = [p for name, p in sig.parameters.items() if name not in ("self", "cls")]
    needed = {p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    allowed = {p.name for p in params}
    raised = _raised(fn)
    if doc is None:
        if needed or (returns and _returns_value(sig)) or raised:
            return [f"{where}: no docstring"]
        return []
    parsed = parse(doc)
    documented = [n.lstrip("*") for n in parsed.names(_ARGS, _ARG)]
    named = {n.rsplit(".", 1)[-1] for n in parsed.names({"Raises"}, _RAISE)}
    problems = [f"{where}: {p}" for p in parsed.problems]
    for title in {"Returns", "Yields"} & parsed.sections.keys():
        for entry in parsed.sections[title]:
            if _NAMED.match(entry):
                problems.append(f"{where}: {title}: {entry!r} reads as 'name (type): text'")
    if missing := sorted(needed - set(documented)):
        problems.append(f"{where}: Args does not name {missing}")
    if extra := sorted(set(documented) - allowed):
        problems.append(f"{where}: Args names {extra}, not parameters of {sig}")
    if returns and _returns_value(sig) and not {"Returns", "Yields"} & parsed.sections.keys():
        problems.append(f"{where}: returns {sig.return_annotation} but has no Returns:")
    if unnamed := sorted(raised - named):
        problems.append(f"{where}: raises {unnamed} but its Raises: does not name them")
    return problems


def check_class(where: str, cls: type) -> list[str]:
    doc = _own_doc(cls)
    problems = [] if doc else [f"{where}: no docstring"]
    init = vars(cls).get("__init__")
    if dataclasses.is_dataclass(cls):
        fields = {f.name for f in dataclasses.fields(cls) if f.init}
        listed = parse(doc or "").names(_ARGS | {"Attributes"}, _ARG)
        if missing := sorted(fields - _field_docs(cls) - set(listed)):
            problems.append(f"{where}: fields without a docstring {missing}")
        if extra := sorted(set(listed) - {f.name for f in dataclasses.fields(cls)}):
            problems.append(f"{where}: documents {extra}, not fields")
    elif inspect.isfunction(init) and not getattr(cls, "_is_protocol", False):
        parsed = parse(doc or "")
        in_class = _ARGS & parsed.sections.keys()
        init_doc = doc if in_class else _own_doc(init)
        problems += check_function(f"{where}.__init__", init, init_doc, returns=False)
    for name, member in vars(cls).items():
        if name.startswith("_"):
            continue
        if isinstance(member, property):
            if member.fget is not None and not _own_doc(member.fget):
                problems.append(f"{where}.{name}: property without a docstring")
            continue
        fn = member.__func__ if isinstance(member, staticmethod | classmethod) else member
        if inspect.isfunction(fn):
            bound = getattr(cls, name)
            problems += check_function(f"{where}.{name}", bound, _method_doc(cls, name))
    return problems


def contract_problems() -> list[str]:
    problems: list[str] = []
    for where, obj in public_objects():
        if inspect.isclass(obj):
            problems += check_class(where, obj)
        else:
            problems += check_function(where, obj, _own_doc(obj))
    return problems


def test_the_listed_packages_are_those_that_declare_all() -> None:
    declaring = sorted(
        ".".join(p.parent.relative_to(SRC).parts)
        for p in (SRC / "unbroken").rglob("__init__.py")
        if re.search(r"^__all__\b", p.read_text(), re.M)
    )
    assert declaring == sorted(PACKAGES)


def test_every_public_name_states_its_contract() -> None:
    problems = contract_problems()
    assert problems == [], "\n".join(problems)


def test_the_checkpointer_takes_the_common_settings_as_typed_keywords() -> None:
    from collections.abc import Sequence

    from unbroken.checkpoint import CheckpointConfig, Checkpointer
    from unbroken.checkpoint.config import SETTINGS

    sig = inspect.signature(Checkpointer)
    keywords = {n for n, p in sig.parameters.items() if p.kind is p.KEYWORD_ONLY}
    fields = typing.get_type_hints(CheckpointConfig)
    assert set(SETTINGS) == keywords & fields.keys()
    assert not [p for p in sig.parameters.values() if p.kind is p.VAR_KEYWORD]
    hints = typing.get_type_hints(Checkpointer.__init__)
    for name in SETTINGS:
        assert sig.parameters[name].default is None, name  # None: the config's value
        wanted = Sequence[str] if name == "peers" else fields[name]
        assert hints[name] == wanted | None, (name, hints[name])


# --- the checker itself fails where it should ---------------------------------------------------


def _documented(x: int, *, y: str = "") -> str:
    """Join.

    Args:
        x: a number
            (continued).
        y: a string.

    Returns:
        Both.

    Raises:
        ValueError: when ``x`` is negative.
    """
    if x < 0:
        raise ValueError(x)
    return f"{x}{y}"


def _undocumented(x: int, *, y: str = "") -> str:
    """Join.

    Args:
        x: a number.
        z: not a parameter.
    """
    if x < 0:
        raise ValueError(x)
    return f"{x}{y}"


def _glued(x: int) -> None:
    """Do.
    Args:
        x: a number.
    """


def _misread(x: int) -> bool:
    """Check.

    Args:
        x: a number.

    Returns:
        True: read as a name by mkdocstrings.
    """
    return x > 0


def test_the_checker_finds_what_a_docstring_misses() -> None:
    assert check_function("ok", _documented, _documented.__doc__) == []
    problems = check_function("bad", _undocumented, _undocumented.__doc__)
    assert any("does not name ['y']" in p for p in problems), problems
    assert any("names ['z']" in p for p in problems), problems
    assert any("no Returns:" in p for p in problems), problems
    assert any("raises ['ValueError']" in p for p in problems), problems
    misread = check_function("misread", _misread, _misread.__doc__)
    assert any("reads as 'name (type): text'" in p for p in misread), misread
    glued = check_function("glued", _glued, _glued.__doc__)
    assert any("no blank line above Args" in p for p in glued), glued


@dataclasses.dataclass(frozen=True)
class _Config:
    """A config."""

    documented: int = 0
    """What it is."""
    bare: int = 0


def test_the_checker_finds_a_field_without_a_docstring() -> None:
    assert check_class("cfg", _Config) == ["cfg: fields without a docstring ['bare']"]


# --- no history and no figures in src/ ----------------------------------------------------------

HASH = re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b")
"""A token that reads as an abbreviated or full commit hash."""
NARRATIVE = re.compile(
    r"\b(measured at|before this change|after this change|at the last measurement|"
    r"in the last measurement|used to (?:be|take|cost)|fell from|rose from|went down from)\b",
    re.I,
)
"""How the code was, or when a figure was taken: that is git's and CHANGELOG.md's."""
FIGURE = re.compile(r"\b\d+\.\d+ ?%|\b\d+(?:\.\d+)? ?[x×] (?:faster|slower|quicker)\b")
"""A measured figure: a decimal percentage, a speed-up."""


def prose(text: str) -> Iterator[tuple[int, str]]:
    """(line, text) of the comments and docstrings (string statements) of Python ``text``."""
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.COMMENT:
            yield tok.start[0], tok.string
    for node in ast.walk(ast.parse(text)):
        value = node.value if isinstance(node, ast.Expr) else None
        if isinstance(value, ast.Constant) and isinstance(value.value, str):
            for i, line in enumerate(value.value.splitlines()):
                yield node.lineno + i, line


def history_problems(root: Path) -> list[str]:
    problems = []
    for path in sorted(root.rglob("*.py")):
        text = path.read_text()
        where = path.relative_to(root)
        for n, line in enumerate(text.splitlines(), 1):
            if m := HASH.search(line):
                problems.append(f"{where}:{n}: commit-hash-like {m.group(0)!r}")
        for n, line in prose(text):
            for pattern in (NARRATIVE, FIGURE):
                if m := pattern.search(line):
                    problems.append(f"{where}:{n}: {m.group(0)!r} in {line.strip()!r}")
    return problems


@pytest.mark.slow
def test_src_states_no_history_and_no_figures() -> None:
    problems = history_problems(SRC)
    assert problems == [], "\n".join(problems)


@pytest.mark.parametrize(
    "line",
    [
        "# see 3f9c2e1 for the fix",
        "# 0.28 s before this change",
        '"""At 89.9% efficiency."""',
        "# the slab is 2.5x faster than a copy",
        "# 2x slower",
        "# at the last measurement it took a second",
    ],
)
def test_the_history_check_finds(tmp_path: Path, line: str) -> None:
    (tmp_path / "m.py").write_text(f"{line}\nX = 1\n")
    assert len(history_problems(tmp_path)) == 1, line


def test_the_history_check_leaves_settings_alone(tmp_path: Path) -> None:
    (tmp_path / "m.py").write_text(
        '"""A keep-alive every 0.25 s; at most 90% of memory; 8 x the largest gap."""\n'
        'DIGEST = "sha256"  # of the whole state\n'
    )
    assert history_problems(tmp_path) == []
