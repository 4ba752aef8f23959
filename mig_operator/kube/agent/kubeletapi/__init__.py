"""The kubelet's DRA (v1), plugin registration and DRA resource health (v1, v1alpha1) gRPC APIs, generated
from k8s.io/kubelet@v0.37.2.

Regenerate with scripts/gen-kubelet-protos; nothing here is written by hand.
"""

DRA_PLUGIN_SERVICE = "v1.DRAPlugin"  # k8s.io/kubelet/pkg/apis/dra/v1 DRAPluginService
DRA_PLUGIN_TYPE = "DRAPlugin"  # k8s.io/kubelet/pkg/apis/pluginregistration/v1 DRAPlugin
# k8s.io/kubelet/pkg/apis/dra-health/{v1,v1alpha1} DRAResourceHealthService: the kubelet (1.37) calls the
# newest one a plugin lists in its supported versions; 1.34's (alpha gate ResourceHealthStatus) calls v1alpha1.
DRA_HEALTH_SERVICES = ("v1.DRAResourceHealth", "v1alpha1.DRAResourceHealth")
