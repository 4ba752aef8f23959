"""The kubelet's DRA (v1) and plugin registration gRPC APIs, generated from k8s.io/kubelet@v0.34.4.

Regenerate with scripts/gen-kubelet-protos; nothing here is written by hand.
"""

DRA_PLUGIN_SERVICE = "v1.DRAPlugin"  # k8s.io/kubelet/pkg/apis/dra/v1 DRAPluginService
DRA_PLUGIN_TYPE = "DRAPlugin"  # k8s.io/kubelet/pkg/apis/pluginregistration/v1 DRAPlugin
