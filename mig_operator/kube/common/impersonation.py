"""Whom a client command acts as: the kubeconfig user's impersonation (``as``, ``as-uid``, ``as-groups``,
``as-user-extra`` under ``users[].user``), which kubectl honours and kubernetes-python's loader ignores,
overridden by kubectl's flags ``--as`` and ``--as-group``.

The kubeconfig is read here as kubectl reads it: the files of ``--kubeconfig``, else of ``$KUBECONFIG``
(a list, ``:``-separated) or ``~/.kube/config``; the first current-context set wins, and the first
definition of a context or user name wins. Each file is read up to ``MAX_KUBECONFIG_BYTES``.
The API server applies the headers (``Impersonate-User``, ``-Uid``, ``-Group``, ``-Extra-<key>``) after
checking that the real user may ``impersonate``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any
from urllib.parse import quote

import yaml

MAX_KUBECONFIG_BYTES = 4 * 2**20
MAX_NAME_LENGTH = 1024  # a user or group name given to impersonate


class ImpersonationError(ValueError):
    """An impersonation that cannot be sent: one line naming what is wrong."""


@dataclass(frozen=True)
class Impersonation:
    """Whom to act as; all empty: the credentials' own user."""

    user: str = ""
    uid: str = ""
    groups: tuple[str, ...] = ()
    extra: tuple[tuple[str, tuple[str, ...]], ...] = ()

    def __bool__(self) -> bool:
        return bool(self.user or self.uid or self.groups or self.extra)

    def overridden(self, user: str | None = None, groups: Sequence[str] | None = None) -> Impersonation:
        """kubectl's rule: ``--as`` replaces the kubeconfig's user, ``--as-group`` its groups."""
        acting = self
        if user:
            acting = replace(acting, user=user)
        if groups:
            acting = replace(acting, groups=tuple(groups))
        return acting

    def check(self) -> Impersonation:
        """Itself, or ImpersonationError: the API server refuses groups, a uid or extras without a user."""
        if not self:
            return self
        if not self.user:
            raise ImpersonationError("impersonating groups, a uid or extras needs a user to impersonate too "
                                     "(the kubeconfig user's 'as:' or --as); e.g. --as jane --as-group team-a")
        for value in (self.user, *self.groups, *(v for _, values in self.extra for v in values)):
            name_flag("impersonated name", value)
        if self.uid:
            name_flag("impersonated uid", self.uid)
        return self

    def headers(self) -> list[tuple[str, str]]:
        """The request headers, in order (one ``Impersonate-Group`` per group)."""
        if not self:
            return []
        out = [("Impersonate-User", self.user)]
        if self.uid:
            out.append(("Impersonate-Uid", self.uid))
        out += [("Impersonate-Group", group) for group in self.groups]
        out += [(f"Impersonate-Extra-{quote(key, safe='')}", value) for key, values in self.extra for value in values]
        return out

    def describe(self) -> str:
        groups = f" (groups {', '.join(self.groups)})" if self.groups else ""
        return f"{self.user}{groups}" if self else "the credentials' own user"


def name_flag(flag: str, text: str) -> str:
    """A name sent in a header: not empty, printable ASCII or Latin-1, at most MAX_NAME_LENGTH characters."""
    bad = (not text or len(text) > MAX_NAME_LENGTH or any(ord(c) < 0x20 or 0x7f <= ord(c) < 0xa0 or ord(c) > 0xff
                                                          for c in text))
    if bad:
        shown = text if len(text) <= 60 else text[:60] + "…"
        raise ImpersonationError(f"{flag} {shown!r} is not a user or group name (1 to {MAX_NAME_LENGTH} printable "
                                 "characters); use e.g. --as jane")
    return text


def kubeconfig_paths(kubeconfig: str | None, default_location: str) -> list[str]:
    """The files kubectl merges: ``kubeconfig``, else ``default_location`` (``$KUBECONFIG`` or ~/.kube/config)."""
    text = kubeconfig if kubeconfig is not None else default_location
    return [os.path.expanduser(part) for part in text.split(os.pathsep) if part]


def _read(path: str) -> Mapping[str, Any]:
    try:
        with open(path, "rb") as fh:
            raw = fh.read(MAX_KUBECONFIG_BYTES + 1)
    except FileNotFoundError:
        return {}  # a missing file of a $KUBECONFIG list is skipped, as kubectl does
    if len(raw) > MAX_KUBECONFIG_BYTES:
        raise ImpersonationError(f"kubeconfig {path} is larger than {MAX_KUBECONFIG_BYTES} bytes")
    try:
        doc = yaml.safe_load(raw)
    except yaml.YAMLError as exc:
        raise ImpersonationError(f"kubeconfig {path} is not YAML: {' '.join(str(exc).split())[:160]}") from None
    return doc if isinstance(doc, Mapping) else {}


def _named(docs: Sequence[Mapping[str, Any]], key: str, name: str, field: str) -> Mapping[str, Any]:
    for doc in docs:
        for entry in doc.get(key) or []:
            if isinstance(entry, Mapping) and entry.get("name") == name and isinstance(entry.get(field), Mapping):
                return entry[field]
    return {}


def _strings(value: Any) -> tuple[str, ...]:
    return tuple(str(v) for v in value) if isinstance(value, list) else ()


def impersonation_of(docs: Sequence[Mapping[str, Any]]) -> Impersonation:
    """The current context's user's impersonation in merged kubeconfig documents (pure)."""
    current = next((str(d["current-context"]) for d in docs if d.get("current-context")), "")
    user_name = _named(docs, "contexts", current, "context").get("user") if current else None
    if not user_name:
        return Impersonation()
    user = _named(docs, "users", str(user_name), "user")
    extra = user.get("as-user-extra")
    return Impersonation(
        user=str(user.get("as") or ""), uid=str(user.get("as-uid") or ""), groups=_strings(user.get("as-groups")),
        extra=tuple(sorted((str(k), _strings(v)) for k, v in extra.items())) if isinstance(extra, Mapping) else (),
    )


def namespace_of(docs: Sequence[Mapping[str, Any]]) -> str:
    """The current context's namespace in merged kubeconfig documents (pure); ``default`` when it names
    none, as kubectl reads it."""
    current = next((str(d["current-context"]) for d in docs if d.get("current-context")), "")
    namespace = _named(docs, "contexts", current, "context").get("namespace") if current else None
    return namespace if isinstance(namespace, str) and namespace else "default"


def kubeconfig_namespace(kubeconfig: str | None, default_location: str) -> str:
    """The namespace the kubeconfig's current context names (``default`` when none)."""
    return namespace_of([_read(path) for path in kubeconfig_paths(kubeconfig, default_location)])


def kubeconfig_impersonation(kubeconfig: str | None, default_location: str) -> Impersonation:
    """The impersonation the kubeconfig's current context asks for (empty when none)."""
    return impersonation_of([_read(path) for path in kubeconfig_paths(kubeconfig, default_location)])
