"""A griffe extension for the documentation site: the API reference shows each default as its value.

The public signatures read their defaults from named constants (``rho: float = RHO``, written once in
``hf_geosharp.engine.defaults``), and griffe renders the source's expression, so the reference would show ``RHO``
where a reader wants ``0.1``. This extension replaces every default that is a name of a constant with the constant's
value (as the constant's assignment writes it, followed through the package's source: nothing is imported), in
signatures and in class attributes. mkdocs.yml loads it; tests/test_docs.py holds the result against
``inspect.signature``.
"""

from __future__ import annotations

import ast
import re
from typing import Any

import griffe

#: A default written as a (dotted) name: the only kind this extension rewrites.
NAME = re.compile(r"[A-Za-z_][\w.]*")


def shown(expression: Any, loader: griffe.GriffeLoader) -> str | None:
    """The value a default's expression names, as its constant's source writes it, or ``None`` to leave it.

    Args:
        expression: the default as griffe parsed it (an expression, a string, or ``None``).
        loader: the loader holding the package's tree, where the name is followed to its assignment (through
            names of names); nothing is imported.

    Returns:
        ``0.1``, ``"inv"``, ... where ``expression`` names a constant assigned a literal; else ``None``.
    """
    seen = set()
    while isinstance(expression, griffe.Expr) and NAME.fullmatch(str(expression)):
        path = getattr(expression, "canonical_path", None)
        if not path or path in seen:
            return None
        seen.add(path)
        try:
            target = loader.modules_collection[path]
        except (KeyError, ValueError, griffe.AliasResolutionError, griffe.CyclicAliasError):
            return None
        if not isinstance(target, griffe.Attribute) or target.value is None:
            return None
        expression = target.final_target.value if target.is_alias else target.value
        if _literal(expression):
            return str(expression)
    return None


def _literal(expression: Any) -> bool:
    """Whether the expression's source is a literal (a number, a string, ``None``, ``True``, ...)."""
    try:
        ast.literal_eval(str(expression))
    except (ValueError, SyntaxError):
        return False
    return True


class ConstantDefaults(griffe.Extension):
    """Defaults and attribute values that name a constant are shown as the constant's value."""

    def on_function(self, *, func: griffe.Function, loader: griffe.GriffeLoader, **kwargs: Any) -> None:
        """Rewrite the function's parameters' defaults (see :func:`shown`).

        Args:
            func: the function, its tree complete.
            loader: the loader holding the tree.
            **kwargs: griffe's other arguments.
        """
        for parameter in func.parameters:
            value = shown(parameter.default, loader)
            if value is not None:
                parameter.default = value

    def on_attribute(self, *, attr: griffe.Attribute, loader: griffe.GriffeLoader, **kwargs: Any) -> None:
        """Rewrite the attribute's value (a dataclass field's default; see :func:`shown`).

        Args:
            attr: the attribute, its tree complete.
            loader: the loader holding the tree.
            **kwargs: griffe's other arguments.
        """
        value = shown(attr.value, loader)
        if value is not None:
            attr.value = value
