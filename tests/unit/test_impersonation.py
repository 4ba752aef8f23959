"""Whom a client command acts as: the kubeconfig user's ``as:``/``as-groups:`` (which kubernetes-python's
loader ignores) read as kubectl reads it, overridden by --as/--as-group, sent as Impersonate-* headers;
a long-running part refuses a kubeconfig that impersonates."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from mig_operator.cli import main
from mig_operator.kube.common.client import CredentialsError, KubeClient, check_credentials
from mig_operator.kube.common.impersonation import Impersonation, ImpersonationError, kubeconfig_impersonation


def write(path: Path, current: str | None, users: dict[str, dict[str, Any]], server: str = "http://127.0.0.1:9",
          contexts: dict[str, str] | None = None) -> Path:
    contexts = contexts if contexts is not None else {name: name for name in users}
    doc: dict[str, Any] = {
        "apiVersion": "v1", "kind": "Config",
        "clusters": [{"name": "c", "cluster": {"server": server}}],
        "users": [{"name": name, "user": {"token": "t", **user}} for name, user in users.items()],
        "contexts": [{"name": ctx, "context": {"cluster": "c", "user": user}} for ctx, user in contexts.items()]}
    if current is not None:
        doc["current-context"] = current
    path.write_text(yaml.safe_dump(doc))
    return path


def test_the_current_contexts_user_is_read_with_all_its_fields(tmp_path: Path) -> None:
    path = write(tmp_path / "k", "tenant", {
        "admin": {"as": "someone-else"},
        "tenant": {"as": "jane", "as-uid": "42", "as-groups": ["team-a", "ml"],
                   "as-user-extra": {"scopes": ["view", "dev"], "reason/x": ["y"]}}})
    acting = kubeconfig_impersonation(str(path), "unused")
    assert acting == Impersonation("jane", "42", ("team-a", "ml"), (("reason/x", ("y",)), ("scopes", ("view", "dev"))))
    assert acting.headers() == [
        ("Impersonate-User", "jane"), ("Impersonate-Uid", "42"), ("Impersonate-Group", "team-a"),
        ("Impersonate-Group", "ml"), ("Impersonate-Extra-reason%2Fx", "y"), ("Impersonate-Extra-scopes", "view"),
        ("Impersonate-Extra-scopes", "dev")]


def test_a_kubeconfig_list_merges_as_kubectl_does(tmp_path: Path) -> None:
    # The first file sets the context; the user is defined first in the second file, again in the third.
    first = write(tmp_path / "1", "ctx", {}, contexts={"ctx": "u"})
    second = write(tmp_path / "2", "other", {"u": {"as": "from-second"}})
    third = write(tmp_path / "3", None, {"u": {"as": "from-third"}})
    listed = ":".join([str(first), str(tmp_path / "missing"), str(second), str(third)])
    assert kubeconfig_impersonation(None, listed).user == "from-second"
    assert kubeconfig_impersonation(str(third), listed) == Impersonation()  # no current context: nobody


def test_no_impersonation_sends_no_header_and_flags_override(tmp_path: Path) -> None:
    plain = write(tmp_path / "plain", "admin", {"admin": {}})
    client = KubeClient.from_environment(str(plain))
    assert not any(k.startswith("Impersonate") for k in client._headers(None))
    acting = write(tmp_path / "acting", "admin", {"admin": {"as": "jane", "as-groups": ["a"]}})
    headers = KubeClient.from_environment(str(acting), as_groups=["b", "c"])._headers("application/json")
    assert headers.getall("Impersonate-User") == ["jane"] and headers.getall("Impersonate-Group") == ["b", "c"]
    assert headers["Authorization"] == "Bearer t"
    flagged = KubeClient.from_environment(str(plain), as_user="sam")._headers(None)
    assert flagged.getall("Impersonate-User") == ["sam"] and "Impersonate-Group" not in flagged


def test_groups_without_a_user_are_refused() -> None:
    with pytest.raises(ImpersonationError, match="needs a user to impersonate"):
        Impersonation(groups=("team-a",)).check()


def test_a_part_refuses_an_impersonating_kubeconfig_and_a_client_command_takes_it(tmp_path: Path) -> None:
    path = write(tmp_path / "k", "admin", {"admin": {"as": "jane"}})
    with pytest.raises(CredentialsError, match="impersonates jane"):
        check_credentials(str(path))
    assert check_credentials(str(path), impersonation=True) == Impersonation("jane")


def test_top_with_a_group_and_no_user_is_one_line_and_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = write(tmp_path / "k", "admin", {"admin": {}})
    assert main(["top", "--kubeconfig", str(path), "--as-group", "team-a"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "needs a user to impersonate" in err
