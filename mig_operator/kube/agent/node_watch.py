"""What the agent takes from its own Node: the MIG label, the Node's UID (its GpuNode's owner), NVIDIA's
device plugin resources (the GpuNode's DevicePluginConflict condition), the admin's GPU health clear mark
(``HEALTH_CLEARED_ANNOTATION``) and, from the node's disk, the container runtime's trust (RuntimeTrusted)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from datetime import datetime

from mig_operator.core.node.device_plugin import DevicePluginCheck, check_node
from mig_operator.core.node.health import cleared_at

from ..common import status
from ..common.client import ApiError, KubeClient
from ..common.names import HEALTH_CLEARED_ANNOTATION, MIG_NODE_LABEL, MIG_NODE_VALUE
from .inventory import RuntimeWatch

log = logging.getLogger("mig_operator.agent")


class NodeWatch:
    """The agent's view of its Node, read on start and at each heartbeat, and taken from its watch events."""

    def __init__(self, node: str, client: KubeClient, toolkit_config: str) -> None:
        self.node = node
        self.client = client
        self.labelled = False
        self.uid = ""  # "": no Node of this name (its GpuNode is not written)
        # Whether NVIDIA's device plugin advertises this node's GPUs too (its Node's capacity), and
        # when that last changed.
        self.device_plugin = DevicePluginCheck(node)
        self.device_plugin_since: str | None = None
        self.runtime = RuntimeWatch(node, toolkit_config) if toolkit_config else None
        self.health_cleared: datetime | None = None  # the admin's clear mark; None: none (or not a time)
        self._cleared_value = ""

    async def read(self) -> None:
        try:
            body = await self.client.get(f"/api/v1/nodes/{self.node}")
        except ApiError as exc:
            if not exc.not_found:
                raise
            self.labelled, self.uid = False, ""
            self._take_device_plugin(DevicePluginCheck(self.node))
            return
        self._take(body)

    async def read_runtime(self) -> None:
        if self.runtime is not None:
            await asyncio.to_thread(self.runtime.read, status.now())

    def _take(self, body: Mapping) -> bool:
        """Note the node's MIG label, UID and device plugin resources; True when the label or what the
        GpuNode says about the device plugin changed."""
        labelled = (body["metadata"].get("labels") or {}).get(MIG_NODE_LABEL) == MIG_NODE_VALUE
        self._take_cleared((body["metadata"].get("annotations") or {}).get(HEALTH_CLEARED_ANNOTATION, ""))
        changed = labelled != self.labelled
        self.labelled, self.uid = labelled, body["metadata"]["uid"]
        return self._take_device_plugin(check_node(self.node, body)) or changed

    def _take_cleared(self, value: str) -> None:
        """Note the admin's GPU health clear mark (the health watch applies it); a value that is no time
        is logged once and ignored."""
        if value == self._cleared_value:
            return
        self._cleared_value, self.health_cleared = value, None
        if not value:
            return
        try:
            self.health_cleared = cleared_at(value)
        except ValueError as exc:
            log.warning("node %s annotation %s: %s", self.node, HEALTH_CLEARED_ANNOTATION, exc)
            return
        log.info("node %s: GPU health cleared at %s: the critical Xids seen until then are forgotten", self.node,
                 value)

    def _take_device_plugin(self, check: DevicePluginCheck) -> bool:
        """Note the device plugin check of the Node; True when it changed (the GpuNode says so at once)."""
        if check == self.device_plugin and self.device_plugin_since is not None:
            return False
        before = self.device_plugin
        if check.conflict != before.conflict or self.device_plugin_since is None:
            self.device_plugin_since = status.now()
        self.device_plugin = check
        if check.conflict:
            log.warning("%s", check.message)
        elif before.conflict:
            log.info("node %s: device plugin conflict resolved (%s)", self.node, check.reason)
        return True

    def changed(self, body: Mapping) -> tuple[bool, bool]:
        """A watch event of the Node: (whether the GpuNode must say something new at once, whether
        this is a Node of this name again, whose GpuNode and ResourceSlice are written anew)."""
        known, labelled = self.uid, self.labelled
        changed = self._take(body)
        if labelled != self.labelled:
            log.info("node %s is %s for MIG now", self.node, "labelled" if self.labelled else "not labelled")
        return changed or self.uid != known, self.uid != known

    def deleted(self) -> None:
        log.warning("node %s was deleted: its GpuNode goes with it", self.node)
        self.labelled, self.uid = False, ""
        self._take_device_plugin(DevicePluginCheck(self.node))
