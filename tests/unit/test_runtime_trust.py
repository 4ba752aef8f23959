"""core/node/runtime_trust.py and the agent's RuntimeWatch: the GpuNode's RuntimeTrusted condition from the
node's NVIDIA container toolkit configuration (issue 24, "the runtime")."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from mig_operator.core.node.device_plugin import DevicePluginCheck
from mig_operator.core.node.runtime_trust import check_toolkit_config
from mig_operator.kube.agent.inventory import RuntimeWatch, gpunode_status

PATH = "/etc/nvidia-container-runtime/config.toml"
KEY = "accept-nvidia-visible-devices-envvar-when-unprivileged"
# The top of the file the toolkit ships (nvidia-ctk config default), the setting commented out.
SHIPPED = f"""#accept-nvidia-visible-devices-as-volume-mounts = false
#{KEY} = true
disable-require = false
supported-driver-capabilities = "compat32,compute,display,graphics,ngx,utility,video"

[nvidia-container-cli]
environment = []
ldconfig = "@/sbin/ldconfig.real"
load-kmods = true

[nvidia-container-runtime]
log-level = "info"
mode = "auto"
runtimes = ["docker-runc", "runc", "crun"]
"""


@pytest.mark.parametrize(("text", "status", "reason"), [
    (SHIPPED, "False", "EnvvarAcceptedByDefault"),  # absent: the toolkit's default is true
    ("", "False", "EnvvarAcceptedByDefault"),
    (f"{KEY} = true\n", "False", "EnvvarAcceptedWhenUnprivileged"),
    (SHIPPED.replace(f"#{KEY} = true", f"{KEY} = true"), "False", "EnvvarAcceptedWhenUnprivileged"),
    (SHIPPED.replace(f"#{KEY} = true", f"{KEY} = false"), "True", "EnvvarRefusedWhenUnprivileged"),
    (f"{KEY}=false", "True", "EnvvarRefusedWhenUnprivileged"),
    # The toolkit reads only the top-level key: one inside a table is not the setting.
    (f"[nvidia-container-runtime]\n{KEY} = false\n", "False", "EnvvarAcceptedByDefault"),
    (f'{KEY} = "false"\n', "Unknown", "ToolkitConfigInvalid"),  # a string, not a boolean
    (f"{KEY} = 0\n", "Unknown", "ToolkitConfigInvalid"),
    (f"{KEY} = false\n{KEY} = true\n", "Unknown", "ToolkitConfigInvalid"),  # a key twice is not TOML
    ("[nvidia-container-cli\n", "Unknown", "ToolkitConfigInvalid"),
    (None, "Unknown", "ToolkitConfigUnreadable"),
])
def test_the_condition_from_the_toolkit_configuration(text: str | None, status: str, reason: str) -> None:
    check = check_toolkit_config("gpu-1", PATH, text, "Permission denied" if text is None else "")
    condition = check.condition("2026-01-01T00:00:00Z")
    assert condition == {"type": "RuntimeTrusted", "status": status, "reason": reason,
                         "message": condition["message"], "lastTransitionTime": "2026-01-01T00:00:00Z"}
    # Every message names the file and the setting; every status but True says what to do.
    assert PATH in condition["message"] and KEY in condition["message"]
    if status != "True":
        assert f"{KEY} = false" in condition["message"]
    if status == "False":
        assert "cdmo.io/runtime-trust=accepted" in condition["message"] and "gpu-1" in condition["message"]
    if text is None:
        assert "Permission denied" in condition["message"] and "--toolkit-config" in condition["message"]


def test_a_long_value_or_path_keeps_the_message_within_the_crds_limit() -> None:
    long_path = "/" + "p" * 3990
    check = check_toolkit_config("gpu-1", long_path, f'{KEY} = "{"x" * 5000}"\n')
    assert check.status == "Unknown" and len(check.condition("t")["message"]) <= 4096


def test_the_agent_reads_the_file_and_moves_the_transition_time_only_with_the_status(tmp_path: Path) -> None:
    config = tmp_path / "config.toml"
    watch = RuntimeWatch("gpu-1", str(config))
    assert watch.condition() is None
    assert watch.read("t0")  # no file yet
    assert (watch.condition() or {})["status"] == "Unknown" and "No such file" in watch.condition()["message"]
    config.write_text(f"{KEY} = true\n")
    assert watch.read("t1")
    assert {k: watch.condition()[k] for k in ("status", "reason", "lastTransitionTime")} == \
        {"status": "False", "reason": "EnvvarAcceptedWhenUnprivileged", "lastTransitionTime": "t1"}
    assert not watch.read("t2")  # unchanged: nothing to write
    config.write_text("")  # absent now: still False, another reason, the same transition time
    assert watch.read("t3")
    assert (watch.condition()["reason"], watch.condition()["lastTransitionTime"]) == ("EnvvarAcceptedByDefault", "t1")
    config.write_text(f"{KEY} = false\n")
    assert watch.read("t4") and (watch.condition()["status"], watch.condition()["lastTransitionTime"]) == ("True", "t4")
    if os.geteuid() != 0:  # root reads a mode-000 file anyway
        config.chmod(0)
        assert watch.read("t5") and watch.condition()["reason"] == "ToolkitConfigUnreadable"

    # Published beside the device plugin's condition, both in one list (a merge patch replaces lists).
    status = gpunode_status([], {}, {}, _empty_record(), False, "t9", device_plugin=DevicePluginCheck("gpu-1"),
                            device_plugin_since="t0", runtime=watch.condition())
    assert [c["type"] for c in status["conditions"]] == ["DevicePluginConflict", "RuntimeTrusted"]
    assert status["conditions"][1] == watch.condition()


def _empty_record():  # type: ignore[no-untyped-def]
    from mig_operator.core.node.lifecycle import OwnerRecord

    return OwnerRecord(boot_id="b")
