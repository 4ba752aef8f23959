//go:build !k8s_pre137

package main

import (
	v1 "k8s.io/api/core/v1"
	"k8s.io/klog/v2"
	podresourcesapi "k8s.io/kubelet/pkg/apis/podresources/v1"
)

// GetDynamicResources implements cm.ContainerManager from Kubernetes v1.37 on (with a logger).
func (m *draContainerManager) GetDynamicResources(logger klog.Logger, pod *v1.Pod, container *v1.Container) []*podresourcesapi.DynamicResource {
	return m.dynamicResources(logger, pod, container)
}
