"""Names that cannot be mistyped: a setting's environment variable or a request's field
that is not one is an error naming the closest real one, never silently ignored."""

from __future__ import annotations

import difflib
import os
import re
import typing
from collections.abc import Iterable, Mapping


def closest(name: str, known: Iterable[str]) -> str | None:
    """The known name `name` most likely misspells, if any is close."""
    known = list(known)
    by_lower = {k.lower(): k for k in known}
    found = difflib.get_close_matches(name.lower(), list(by_lower), n=1, cutoff=0.6)
    return by_lower[found[0]] if found else None


def did_you_mean(name: str, known: Iterable[str]) -> str:
    """'; did you mean X?' when a known name is close, else the names there are."""
    known = sorted(known)
    near = closest(name, known)
    if near is not None:
        return f"; did you mean {near!r}?"
    return f"; known: {', '.join(known)}" if len(known) <= 12 else ""


# What Kubernetes sets in every pod for a Service named like the prefix (`verifier`):
# VERIFIER_SERVICE_HOST, VERIFIER_SERVICE_PORT(_NAME), VERIFIER_PORT(_8000_TCP(_ADDR...)).
SERVICE_VARIABLE = re.compile(
    r"(SERVICE_HOST|SERVICE_PORT(_\w+)?|PORT(_\d+_(TCP|UDP|SCTP)(_\w+)?)?)"
)


def unknown_variables(
    prefix: str, fields: Iterable[str], environ: Mapping[str, str] | None = None
) -> list[str]:
    """One message per `prefix`* environment variable that names no setting (and is not
    one a container platform sets for a service of that name)."""
    environ = os.environ if environ is None else environ
    fields = [field.upper() for field in fields]
    messages = []
    for variable in sorted(environ):
        name = variable.upper()
        if not name.startswith(prefix):
            continue
        rest = name.removeprefix(prefix)
        if rest in fields or SERVICE_VARIABLE.fullmatch(rest):
            continue
        near = closest(rest, fields)  # compared without the prefix every name shares
        hint = f"; did you mean {prefix}{near}?" if near else f" (see the settings: {prefix}*)"
        messages.append(f"{variable} is not a setting{hint}")
    return messages


def fields_at(model: type, path: Iterable[object]) -> list[str]:
    """The field names of the pydantic model found at `path` inside `model` (list indexes
    skipped); [] when the path leads to no model."""
    for part in path:
        if isinstance(part, int):
            continue
        field = getattr(model, "model_fields", {}).get(part)
        if field is None:
            return []
        found = _model_in(field.annotation)
        if found is None:
            return []
        model = found
    return list(getattr(model, "model_fields", {}))


def _model_in(annotation: object) -> type | None:
    if isinstance(annotation, type) and hasattr(annotation, "model_fields"):
        return annotation
    for arg in typing.get_args(annotation):
        found = _model_in(arg)
        if found is not None:
            return found
    return None
