"""Every pointer a docstring of `phasescope/` makes to the package resolves: no stale names after a refactor.

A pointer is a dotted name (`phasescope.serve.app.Server`) or a path (`phasescope/serve/app.py`). A dotted name
resolves when its longest module prefix is found (`importlib.util.find_spec`, which imports the parent packages
and nothing else) and the next name, if any, is defined at the top of that module's source (read with `ast`,
not imported, so no pointer loads vLLM or torch), or names a service, message or enum of the gRPC contract's
package (`phasescope.v1.Inference`). A path resolves when the file exists.
"""

from __future__ import annotations

import ast
import importlib.machinery
import importlib.util
import re
import sys
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "phasescope"

DOTTED = re.compile(r"(?<![\w./-])phasescope(?:\.[A-Za-z_][A-Za-z0-9_]*)+")
PATH = re.compile(r"(?<![\w./-])phasescope/[\w/.-]*?\.pyi?\b")
PROTO_DECLARATION = re.compile(r"^(?:service|message|enum)\s+(\w+)", re.MULTILINE)
PROTO_PACKAGE = re.compile(r"^package\s+([\w.]+)\s*;", re.MULTILINE)


def docstrings(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    nodes = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    return [text for node in ast.walk(tree) if isinstance(node, nodes) if (text := ast.get_docstring(node))]


def top_level_names(statements: list[ast.stmt]) -> set[str]:
    """The names a module's body binds, including those under its top-level `if`, `try` and `with` blocks."""
    names: set[str] = set()
    for statement in statements:
        match statement:
            case ast.FunctionDef(name=name) | ast.AsyncFunctionDef(name=name) | ast.ClassDef(name=name):
                names.add(name)
            case ast.Assign(targets=targets):
                names.update(node.id for target in targets for node in ast.walk(target) if isinstance(node, ast.Name))
            case ast.AnnAssign(target=ast.Name(id=name)) | ast.AugAssign(target=ast.Name(id=name)):
                names.add(name)
            case ast.Import(names=aliases) | ast.ImportFrom(names=aliases):
                names.update((alias.asname or alias.name).split(".")[0] for alias in aliases)
            case ast.If(body=body, orelse=orelse):
                names |= top_level_names(body) | top_level_names(orelse)
            case ast.Try(body=body, handlers=handlers, orelse=orelse, finalbody=finalbody):
                names |= top_level_names(body) | top_level_names(orelse) | top_level_names(finalbody)
                for handler in handlers:
                    names |= top_level_names(handler.body)
            case ast.With(body=body):
                names |= top_level_names(body)
    return names


@cache
def module_names(origin: str) -> frozenset[str]:
    """What a module defines, read from its source and, for generated code, its stub beside it."""
    names: set[str] = set()
    for source in (Path(origin), Path(origin).with_suffix(".pyi")):
        if source.is_file():
            names |= top_level_names(ast.parse(source.read_text(encoding="utf-8"), filename=str(source)).body)
    return frozenset(names)


@cache
def proto_names() -> frozenset[str]:
    """The contract's services, messages and enums by their full names (`phasescope.v1.Inference`)."""
    names: set[str] = set()
    for proto in (ROOT / "proto").rglob("*.proto"):
        text = proto.read_text(encoding="utf-8")
        package = PROTO_PACKAGE.search(text)
        prefix = f"{package.group(1)}." if package else ""
        names.update(prefix + name for name in PROTO_DECLARATION.findall(text))
    return frozenset(names)


@cache
def find_module(name: str) -> importlib.machinery.ModuleSpec | None:
    """The module's spec, or None when there is no such module."""
    try:
        return importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None


def why_unresolved(pointer: str) -> str | None:
    """None when the dotted name resolves, else what is missing."""
    if any(pointer == name or pointer.startswith(name + ".") for name in proto_names()):
        return None
    parts = pointer.split(".")
    # Outward from the top package, one name at a time: `find_spec` imports the parent of the name it is given,
    # so asking only beneath packages keeps every plain module (the vLLM adapter's among them) unimported.
    spec = find_module(parts[0])
    if spec is None:
        return "no such module"
    for end in range(1, len(parts)):
        child = find_module(".".join(parts[: end + 1])) if spec.submodule_search_locations is not None else None
        if child is not None:
            spec = child
            continue
        module, attribute = ".".join(parts[:end]), parts[end]
        if spec.origin is not None and attribute in module_names(spec.origin):
            return None
        if spec.submodule_search_locations is not None:
            return f"the package {module} has no module or attribute {attribute}"
        return f"the module {module} defines no {attribute}"
    return None


def file_missing(mention: str) -> bool:
    """Whether a path named from the checkout's root (`phasescope/serve/app.py`) is not a file there."""
    return not (ROOT / mention).is_file()


def broken_pointers() -> list[str]:
    broken = []
    for path in sorted(PACKAGE.rglob("*.py")):
        where = path.relative_to(ROOT)
        for text in docstrings(path):
            for pointer in sorted(set(DOTTED.findall(text))):
                if (why := why_unresolved(pointer)) is not None:
                    broken.append(f"{where}: {pointer} ({why})")
            for mention in sorted(set(PATH.findall(text))):
                if file_missing(mention):
                    broken.append(f"{where}: {mention} (no such file)")
    return broken


def test_every_pointer_in_a_docstring_resolves() -> None:
    before = set(sys.modules)
    broken = broken_pointers()
    heavy = sorted(name for name in set(sys.modules) - before if name.split(".")[0] in {"vllm", "torch"})
    assert not heavy, f"resolving the pointers imported {heavy[:5]}"
    assert not broken, "docstrings name what does not exist:\n" + "\n".join(broken)


def test_the_check_tells_a_stale_pointer_from_a_live_one() -> None:
    assert why_unresolved("phasescope.serve.app.Server") is None
    assert why_unresolved("phasescope.serve.app") is None
    assert why_unresolved("phasescope.v1.Inference") is None
    assert why_unresolved("phasescope.serve.errors") is not None
    assert why_unresolved("phasescope.serve.app.NoSuchThing") is not None
    assert why_unresolved("phasescope.nowhere") is not None
    mentions = PATH.findall("see phasescope/serve/app.py, and phasescope/serve/errors.py.")
    assert mentions == ["phasescope/serve/app.py", "phasescope/serve/errors.py"]
    assert [file_missing(mention) for mention in mentions] == [False, True]
