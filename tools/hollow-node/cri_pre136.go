//go:build k8s_pre136

package main

import (
	"time"

	"go.opentelemetry.io/otel/trace/noop"
	internalapi "k8s.io/cri-api/pkg/apis"
	remote "k8s.io/cri-client/pkg"
	"k8s.io/klog/v2"
)

// newRuntimeService connects the kubelet's CRI client to the fake runtime at endpoint
// (k8s.io/cri-client before v0.36: a logger instead of a context).
func newRuntimeService(endpoint string) (internalapi.RuntimeService, error) {
	logger := klog.Background()
	return remote.NewRemoteRuntimeService(endpoint, 15*time.Second, noop.NewTracerProvider(), &logger)
}
