//go:build !k8s_pre136

package main

import (
	"context"
	"time"

	"go.opentelemetry.io/otel/trace/noop"
	internalapi "k8s.io/cri-api/pkg/apis"
	remote "k8s.io/cri-client/pkg"
)

// newRuntimeService connects the kubelet's CRI client to the fake runtime at endpoint
// (k8s.io/cri-client v0.36 and later: a context, and unary list calls instead of streaming).
func newRuntimeService(endpoint string) (internalapi.RuntimeService, error) {
	return remote.NewRemoteRuntimeService(context.Background(), endpoint, 15*time.Second, noop.NewTracerProvider(), false)
}
