"""kopf's peer identity without a passwd entry for the process's uid (the image's 65532)."""

from __future__ import annotations

import getpass
import os
import pwd
import socket

import pytest

from mig_operator.kube.common import operator


def test_own_identity_needs_no_passwd_entry(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_entry(uid: int) -> pwd.struct_passwd:
        raise KeyError(f"getpwuid(): uid not found: {uid}")

    monkeypatch.setattr(pwd, "getpwuid", no_entry)
    for name in ("LOGNAME", "USER", "LNAME", "USERNAME"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(KeyError):  # what kopf's default identity calls, in a container as uid 65532
        getpass.getuser()
    assert operator.own_identity() == f"{socket.gethostname()}/{os.getpid()}"


def test_run_operator_passes_its_own_identity(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[str, object] = {}

    async def fake_operator(**kwargs: object) -> None:
        seen.update(kwargs)

    monkeypatch.setattr(operator.kopf, "operator", fake_operator)
    operator.run_operator(operator.kopf.OperatorRegistry(), standalone=True)
    assert seen["identity"] == operator.own_identity()
