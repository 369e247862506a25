"""A Griffe extension that turns the docstrings' Sphinx roles into links of the API reference.

The docstrings cross-reference with Sphinx roles, ``:func:`~arithinterp.causal.das_layers```,
``:class:`PromptSet```, ``:meth:`locate```, which Markdown would print as they are. Each role's
target is resolved the way Python resolves the name where the docstring stands (the object's class,
its module, its package, then ``arithinterp``) and written as an mkdocstrings cross-reference,
``[`das_layers`][arithinterp.causal.das_layers]``, to where ``scripts/api_docs.py`` documents the
object; a target the reference does not document (a private helper, another package's object) is
written as code. ``~`` keeps the last name only, ``title <target>`` gives the text.

mkdocs.yml loads it: ``extensions: [scripts/docs_roles.py]``.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import re
import sys
import types
from pathlib import Path
from typing import Any, Optional

import griffe

ROOT = Path(__file__).resolve().parents[1]
ROLE = re.compile(r":(?:py:)?(?:func|class|meth|mod|attr|data|exc|obj|const):`(?P<body>[^`]+)`")


def _api_docs() -> types.ModuleType:
    spec = importlib.util.spec_from_file_location("api_docs", ROOT / "scripts" / "api_docs.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Targets:
    """Where the API reference documents each object: its identifier there, found by the object."""

    def __init__(self) -> None:
        self.by_object: dict[int, str] = {}  # id(module, class or function) -> documented path
        self.keep: list[Any] = []  # those objects, alive while their ids are keys
        self.constants: list[tuple[str, Any, str]] = []  # (name, value, documented path)
        for module, names in _api_docs().documented():
            self._add(module, module.__name__)
            for name in names:
                obj = getattr(module, name)
                path = f"{module.__name__}.{name}"
                if inspect.isclass(obj) or inspect.isfunction(obj):
                    self._add(obj, path)
                else:  # a value: equal small values share an identity, so the name must match too
                    self.constants.append((name, obj, path))

    def _add(self, obj: Any, path: str) -> None:
        self.keep.append(obj)
        self.by_object.setdefault(id(obj), path)

    def find(self, obj: Any, name: str) -> Optional[str]:
        path = self.by_object.get(id(obj))
        if path is None:
            path = next((p for n, value, p in self.constants if n == name and value is obj), None)
        return path

    def member(self, owner: type, name: str) -> Optional[str]:
        """A method or property of a documented class; the reference shows those with a docstring."""
        for cls in inspect.getmro(owner):
            path = self.by_object.get(id(cls))
            member = vars(cls).get(name)
            if path is not None and not name.startswith("_") and getattr(member, "__doc__", None) and (
                    callable(member) or isinstance(member, (property, staticmethod, classmethod))):
                return f"{path}.{name}"
        return None


def _resolve(path: str) -> Optional[tuple[Any, Optional[type], str]]:
    """``(object, owning class or None, last name)`` for a dotted path, or ``None``."""
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        owner = None
        for name in parts[cut:]:
            if not hasattr(obj, name):
                return None
            owner = obj if inspect.isclass(obj) else None
            obj = getattr(obj, name)
        return obj, owner, parts[-1]
    return None


class SphinxRoles(griffe.Extension):
    """Rewrites every docstring of the package once it is loaded."""

    def __init__(self) -> None:
        super().__init__()
        self.targets: Optional[Targets] = None

    def on_package(self, *, pkg: griffe.Module, loader: griffe.GriffeLoader, **kwargs: Any) -> None:
        if pkg.path != "arithinterp":
            return
        sys.path.insert(0, str(ROOT))
        try:
            self.targets = Targets()
            self._rewrite(pkg)
        finally:
            sys.path.remove(str(ROOT))

    def _rewrite(self, obj: griffe.Object) -> None:
        if obj.docstring is not None:
            obj.docstring.value = ROLE.sub(lambda match: self._link(match["body"], obj), obj.docstring.value)
        for member in obj.members.values():
            if not member.is_alias:
                self._rewrite(member)  # type: ignore[arg-type]

    def _link(self, body: str, where: griffe.Object) -> str:
        titled = re.fullmatch(r"(?P<title>.+?)\s*<(?P<target>[^>]+)>", body)
        target = (titled["target"] if titled else body).strip().lstrip("~.")
        text = titled["title"] if titled else (target.rsplit(".", 1)[-1] if body.startswith("~") else target)
        path = self._documented(target, where)
        return f"[`{text}`][{path}]" if path else f"`{text}`"

    def _documented(self, target: str, where: griffe.Object) -> Optional[str]:
        assert self.targets is not None
        scopes: list[str] = []  # where Python would look the name up: the class, the module, the packages
        scope: Optional[griffe.Object] = where
        while scope is not None:
            if scope.is_class or scope.is_module:
                scopes.append(scope.path)
            scope = scope.parent
        for prefix in [*scopes, ""]:
            found = _resolve(f"{prefix}.{target}" if prefix else target)
            if found is None:
                continue
            obj, owner, name = found
            if owner is not None:
                path = self.targets.member(owner, name)
                if path:
                    return path
            path = self.targets.find(obj, name)
            if path:
                return path
        return None
