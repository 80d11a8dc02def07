"""A griffe extension for the API reference: a parameter whose default is read from the package's table of defaults
(``init_scale: float = DEFAULTS["init_scale"]``) shows the value itself (``= 65536.0``), as ``help()`` does, not
the expression. The values come from ``lightning_mp.settings.DEFAULTS``, imported at build time.

The source is not changed, only what griffe hands to mkdocstrings."""

from __future__ import annotations

import importlib
import re
from typing import Any

import griffe

LOOKUP = re.compile(r"""^DEFAULTS\[(["'])(?P<name>\w+)\1\]$""")


class DefaultValues(griffe.Extension):
    """Replace ``DEFAULTS["name"]`` defaults in signatures with ``repr`` of the value."""

    def _rewrite(self, pkg: griffe.Module) -> None:
        defaults = importlib.import_module("lightning_mp.settings").DEFAULTS
        seen: set[int] = set()

        def visit(obj: Any) -> None:
            if obj.is_alias or id(obj) in seen:
                return
            seen.add(id(obj))
            for parameter in getattr(obj, "parameters", None) or ():
                found = LOOKUP.match(str(parameter.default)) if parameter.default is not None else None
                if found and found["name"] in defaults:
                    parameter.default = repr(defaults[found["name"]])
            for member in obj.members.values():
                visit(member)

        visit(pkg)

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        if pkg.path == "lightning_mp":
            self._rewrite(pkg)

    # griffe 1's name of the same hook (griffe 2 calls on_package only)
    on_package_loaded = on_package
