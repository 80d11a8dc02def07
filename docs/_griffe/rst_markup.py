"""A griffe extension for the API reference: the package's docstrings use two pieces of reStructuredText that
Markdown would show as literal text.

- Sphinx roles (``:class:`Name```, ``:meth:`~pkg.Class.method```, ``:mod:`...```): each becomes inline code that
  links to the object where the site documents it (an optional cross-reference: a target the site does not render
  stays plain code, without a warning).
- The literal-block marker (``Example::`` before an indented block): the line ends in one colon; the indented block
  is a code block in Markdown as well.

The docstrings themselves are not changed, only what griffe hands to mkdocstrings."""

from __future__ import annotations

import re
from typing import Any

import griffe

LITERAL_MARKER = re.compile(r"(?m)(?<=\S)::$")
ROLE = re.compile(
    r":(?:py:)?(?:class|func|meth|attr|data|mod|exc|obj|const):`(?P<tilde>~?)(?P<target>[\w.]+)(?:\(\))?`"
)


def _find(pkg: griffe.Module, path: str) -> Any:
    root = pkg.path + "."
    if path == pkg.path:
        return pkg
    if not path.startswith(root):
        return None
    try:
        return pkg[path[len(root) :]]
    except (KeyError, ValueError, griffe.AliasResolutionError, griffe.CyclicAliasError):
        return None


def _resolve(pkg: griffe.Module, obj: griffe.Object, target: str) -> str | None:
    """The canonical path of ``target`` as written in ``obj``'s docstring: absolute, or relative to ``obj``, its
    parents or the package root."""
    scopes = [target]
    scope: Any = obj
    while scope is not None:
        scopes.append(f"{scope.path}.{target}")
        scope = scope.parent
    for path in scopes:
        found = _find(pkg, path)
        if found is not None:
            try:
                return found.canonical_path
            except griffe.AliasResolutionError:
                return path
    return None


class RstMarkup(griffe.Extension):
    """Rewrite Sphinx roles as Markdown code with optional cross-references, and ``::`` markers as one colon."""

    def _rewrite(self, pkg: griffe.Module) -> None:
        seen: set[int] = set()

        def visit(obj: Any) -> None:
            if obj.is_alias or id(obj) in seen:
                return
            seen.add(id(obj))
            doc = obj.docstring
            if doc is not None:

                def code(match: re.Match) -> str:
                    target = match["target"]
                    text = target.rsplit(".", 1)[-1] if match["tilde"] else target
                    path = _resolve(pkg, obj, target)
                    if path is None:
                        return f"`{text}`"
                    return f'<autoref identifier="{path}" optional><code>{text}</code></autoref>'

                doc.value = LITERAL_MARKER.sub(":", ROLE.sub(code, doc.value))
            for member in obj.members.values():
                visit(member)

        visit(pkg)

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        self._rewrite(pkg)

    # griffe 1's name of the same hook (griffe 2 calls on_package only); a second pass changes nothing
    on_package_loaded = on_package
