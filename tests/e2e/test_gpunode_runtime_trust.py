"""The agent publishes its node's RuntimeTrusted condition (issue 24, "the runtime") on a real API
server, with the chart's agent credentials, beside DevicePluginConflict: what the node's NVIDIA
toolkit configuration says, checked against the file the test wrote (not the agent's own reading)."""

from __future__ import annotations

from pathlib import Path

from harness import OperatorHarness, wait_until

KEY = "accept-nvidia-visible-devices-envvar-when-unprivileged"


def conditions(operator: OperatorHarness, node) -> dict[str, dict]:  # type: ignore[no-untyped-def]
    body = operator.gpunode(node) or {}
    return {c["type"]: c for c in (body.get("status") or {}).get("conditions") or []}


def test_runtime_trusted_follows_the_toolkit_configuration(operator: OperatorHarness, tmp_path: Path) -> None:
    cases = {  # the file's text -> (status, reason); None: no file
        f"{KEY} = true\n": ("False", "EnvvarAcceptedWhenUnprivileged"),
        "[nvidia-container-runtime]\nmode = \"cdi\"\n": ("False", "EnvvarAcceptedByDefault"),
        f"{KEY} = false\n": ("True", "EnvvarRefusedWhenUnprivileged"),
        None: ("Unknown", "ToolkitConfigUnreadable"),
    }
    for n, (text, (status, reason)) in enumerate(cases.items()):
        node = operator.add_node("l4-24gb", labelled=False)
        config = tmp_path / f"toolkit-{n}" / "config.toml"
        config.parent.mkdir()
        if text is not None:
            config.write_text(text)
        operator.agent(node, None, "--toolkit-config", str(config))
        found = wait_until(lambda node=node: conditions(operator, node).get("RuntimeTrusted"), 30,
                           lambda node=node: f"GpuNode {node.name}'s RuntimeTrusted\n{operator.logs()}")
        assert (found["status"], found["reason"]) == (status, reason), found
        assert str(config) in found["message"] and KEY in found["message"] and found["lastTransitionTime"]
        if status == "False":
            assert "cdmo.io/runtime-trust=accepted" in found["message"]
        # Beside the device plugin's condition, both kept by the API server (a list keyed by type).
        assert set(conditions(operator, node)) == {"DevicePluginConflict", "RuntimeTrusted"}
