"""The agent as the kubelet's DRA plugin for driver ``gpu.cdmo.io`` (Kubernetes 1.34, DRA v1 gRPC).

Two unix sockets, as the kubelet's plugin manager expects:

- ``<registry dir>/gpu.cdmo.io-reg.sock``: the plugin registration service. The kubelet finds the
  socket, calls ``GetInfo`` (type ``DRAPlugin``, our name, the DRA socket, the service ``v1.DRAPlugin``)
  and then ``NotifyRegistrationStatus``.
- ``<plugin dir>/dra.sock``: ``NodePrepareResources`` / ``NodeUnprepareResources``, and the resource
  health stream ``NodeWatchResources`` (``v1.DRAResourceHealth`` and ``v1alpha1``, listed in ``GetInfo``):
  each device's health from its GPU's, for the pod's ``allocatedResourcesStatus``.

Prepare reads each ResourceClaim from the API server, checks that what the scheduler allocated from
this driver is a device of this node's pool, a slice the agent holds Ready, and that the claim is that
slice's own (``core.books.claim_owner``: a claim of another namespace may be allocated any device its
selector matches, so the scheduler's word is not enough), writes the slice's CDI spec (for a fraction,
after making the slice's ledger directory and writing its limit file and ld.so.preload, which the
spec mounts) and answers its CDI device ID (plus the
NVIDIA toolkit's ID for the same UUID where the node has
that spec: the driver's user-space libraries come from it). The prepared claim is recorded before
the answer, so that an agent restarted later still unprepares it and still holds the instance.
Both calls are idempotent; a claim's failure is its own error string, which the kubelet shows in
the pod's events.
"""

# Rooms: ``settings`` (directories, sockets), ``files`` (what a prepare writes on the host),
# ``prepare`` (what a claim needs before the kubelet starts its containers), ``health`` (the devices'
# health stream), ``transport`` (the two gRPC servers on their unix sockets).
