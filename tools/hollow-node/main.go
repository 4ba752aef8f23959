// hollow-node runs the real kubelet code of k8s.io/kubernetes (through kubemark's HollowKubelet)
// with a fake CRI runtime, like `kubemark --morph=kubelet`, with two differences that the e2e
// tests need:
//
//   - The kubelet root directory is a flag (kubemark always makes /tmp/hollow-kubelet.XXXX,
//     test/utils/tmpdir.go:27), so the plugin registry (<root>/plugins_registry) and the DRA
//     manager's checkpoint sit where the control plane's state dir says.
//   - The container manager hands DRA to the kubelet's real DRA manager (pkg/kubelet/cm/dra).
//     kubemark's stub container manager registers no DRA plugin handler and its
//     PrepareDynamicResources/UnprepareDynamicResources do nothing
//     (pkg/kubelet/cm/container_manager_stub.go:97-99, 181-187), so a stock hollow node never
//     calls a DRA driver. Here the kubelet registers DRA plugins from the registry directory and
//     calls NodePrepareResources/NodeUnprepareResources exactly as a cluster's kubelet does.
//
// It is built by scripts/control-plane inside the k8s.io/kubernetes wrapper module (this
// directory has no go.mod of its own: the wrapper supplies the staging-module replacements).
// Where a kubelet API differs between the supported releases, a pair of files holds one variant
// each, chosen by a build tag the script sets from the release: k8s_pre136 (cri_*.go) below
// v1.36, k8s_pre137 (podresources_*.go) below v1.37; without tags the newest API is built.
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"

	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	"k8s.io/apimachinery/pkg/types"
	clientset "k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/klog/v2"
	pluginwatcherapi "k8s.io/kubelet/pkg/apis/pluginregistration/v1"
	podresourcesapi "k8s.io/kubelet/pkg/apis/podresources/v1"
	"k8s.io/kubernetes/cmd/kubelet/app/options"
	kubeletconfig "k8s.io/kubernetes/pkg/kubelet/apis/config"
	cadvisortest "k8s.io/kubernetes/pkg/kubelet/cadvisor/testing"
	"k8s.io/kubernetes/pkg/kubelet/cm"
	"k8s.io/kubernetes/pkg/kubelet/cm/dra"
	"k8s.io/kubernetes/pkg/kubelet/config"
	kubecontainer "k8s.io/kubernetes/pkg/kubelet/container"
	"k8s.io/kubernetes/pkg/kubelet/pluginmanager/cache"
	"k8s.io/kubernetes/pkg/kubelet/status"
	"k8s.io/kubernetes/pkg/kubemark"

	internalapi "k8s.io/cri-api/pkg/apis"
	fakeremote "k8s.io/cri-client/pkg/fake"
)

// draContainerManager is kubemark's stub container manager with the DRA calls routed to the
// kubelet's own DRA manager, the way containerManagerImpl (container_manager_linux.go) does.
type draContainerManager struct {
	cm.ContainerManager
	dra *dra.Manager
}

func (m *draContainerManager) Start(ctx context.Context, node *v1.Node, activePods cm.ActivePodsFunc,
	getNode cm.GetNodeFunc, sourcesReady config.SourcesReady, podStatus status.PodStatusProvider,
	runtime internalapi.RuntimeService, localStorageIsolation bool) error {
	if err := m.ContainerManager.Start(ctx, node, activePods, getNode, sourcesReady, podStatus, runtime, localStorageIsolation); err != nil {
		return err
	}
	return m.dra.Start(ctx, dra.ActivePodsFunc(activePods), dra.GetNodeFunc(getNode), sourcesReady)
}

func (m *draContainerManager) GetPluginRegistrationHandlers() map[string]cache.PluginHandler {
	return map[string]cache.PluginHandler{pluginwatcherapi.DRAPlugin: m.dra.GetWatcherHandler()}
}

func (m *draContainerManager) PrepareDynamicResources(ctx context.Context, pod *v1.Pod) error {
	return m.dra.PrepareResources(ctx, pod)
}

func (m *draContainerManager) UnprepareDynamicResources(ctx context.Context, pod *v1.Pod) error {
	return m.dra.UnprepareResources(ctx, pod)
}

func (m *draContainerManager) PodMightNeedToUnprepareResources(uid types.UID) bool {
	return m.dra.PodMightNeedToUnprepareResources(uid)
}

// GetResources adds the CDI device IDs the driver returned, as the real kubelet passes them to
// the runtime (the fake runtime ignores them, but the kubelet's path is the same).
func (m *draContainerManager) GetResources(ctx context.Context, pod *v1.Pod, container *v1.Container) (*kubecontainer.RunContainerOptions, error) {
	opts, err := m.ContainerManager.GetResources(ctx, pod, container)
	if err != nil {
		return nil, err
	}
	info, err := m.dra.GetResources(pod, container)
	if err != nil {
		return nil, err
	}
	opts.CDIDevices = append(opts.CDIDevices, info.CDIDevices...)
	return opts, nil
}

// dynamicResources feeds the kubelet's pod-resources API (<root>/pod-resources/kubelet.sock);
// GetDynamicResources (podresources_*.go, one signature per Kubernetes release range) calls it.
func (m *draContainerManager) dynamicResources(logger klog.Logger, pod *v1.Pod, container *v1.Container) []*podresourcesapi.DynamicResource {
	infos, err := m.dra.GetContainerClaimInfos(pod, container)
	if err != nil {
		logger.Error(err, "reading claim infos", "pod", klog.KObj(pod))
		return nil
	}
	var out []*podresourcesapi.DynamicResource
	for _, info := range infos {
		res := &podresourcesapi.DynamicResource{ClaimName: info.ClaimName, ClaimNamespace: info.Namespace}
		for driver, state := range info.DriverState {
			for _, dev := range state.Devices {
				claimRes := &podresourcesapi.ClaimResource{DriverName: driver, PoolName: dev.PoolName, DeviceName: dev.DeviceName}
				for _, id := range dev.CDIDeviceIDs {
					claimRes.CdiDevices = append(claimRes.CdiDevices, &podresourcesapi.CDIDevice{Name: id})
				}
				res.ClaimResources = append(res.ClaimResources, claimRes)
			}
		}
		out = append(out, res)
	}
	return out
}

type settings struct {
	kubeconfig string
	nodeName   string
	rootDir    string
	address    string
	port       int
	maxPods    int
	labels     string
	resources  string
}

func parseSettings() settings {
	var s settings
	klog.InitFlags(nil)
	flag.StringVar(&s.kubeconfig, "kubeconfig", "", "kubeconfig of the API server (required)")
	flag.StringVar(&s.nodeName, "name", "", "name of the Node to register (required)")
	flag.StringVar(&s.rootDir, "root-dir", "", "kubelet root directory (required); plugins register in <root-dir>/plugins_registry")
	flag.StringVar(&s.address, "address", "127.0.0.1", "address of the kubelet's API server")
	flag.IntVar(&s.port, "kubelet-port", 0, "kubelet API port (0: any free port)")
	flag.IntVar(&s.maxPods, "max-pods", 110, "pods the node accepts")
	flag.StringVar(&s.labels, "node-labels", "", "labels of the Node, k=v,k2=v2")
	flag.StringVar(&s.resources, "extended-resources", "", "extended resources of the Node, name=quantity,...")
	flag.Parse()
	for name, v := range map[string]string{"--kubeconfig": s.kubeconfig, "--name": s.nodeName, "--root-dir": s.rootDir} {
		if v == "" {
			fmt.Fprintf(os.Stderr, "hollow-node: %s is required, e.g. hollow-node --kubeconfig kc --name hollow-0 --root-dir /tmp/cp/hollow-node\n", name)
			os.Exit(2)
		}
	}
	return s
}

// pairs parses "k=v,k2=v2".
func pairs(flagName, text string) map[string]string {
	out := map[string]string{}
	for _, item := range strings.Split(text, ",") {
		if item == "" {
			continue
		}
		k, v, ok := strings.Cut(item, "=")
		if !ok || k == "" {
			fmt.Fprintf(os.Stderr, "hollow-node: %s item %q is not key=value, e.g. %s=example.com/a=1\n", flagName, item, flagName)
			os.Exit(2)
		}
		out[k] = v
	}
	return out
}

// kubeletSettings are the kubelet's defaults with what a process without cgroups, a real
// runtime or root-owned paths needs; every path is under the root directory.
func kubeletSettings(s settings, runtimeEndpoint string) (*options.KubeletFlags, *kubeletconfig.KubeletConfiguration, error) {
	f := options.NewKubeletFlags()
	f.RootDirectory = s.rootDir
	f.CertDirectory = filepath.Join(s.rootDir, "pki")
	f.HostnameOverride = s.nodeName
	f.NodeLabels = pairs("--node-labels", s.labels)

	c, err := options.NewKubeletConfiguration()
	if err != nil {
		return nil, nil, err
	}
	c.ContainerRuntimeEndpoint = runtimeEndpoint
	c.ImageServiceEndpoint = runtimeEndpoint
	c.StaticPodPath = filepath.Join(s.rootDir, "static-pods")
	c.PodLogsDir = filepath.Join(s.rootDir, "pod-logs")
	c.EnableServer = true
	c.Address = s.address
	c.Port = int32(s.port)
	c.ReadOnlyPort = 0
	// RunKubelet serves no /healthz (only the kubelet command's own run() does); readiness is the
	// Node's Ready condition.
	c.HealthzPort = 0
	c.MaxPods = int32(s.maxPods)
	c.RegisterNode = true
	c.ProviderID = "hollow-node://" + s.nodeName
	// No cgroups are managed (stub container manager); no cluster DNS; no kernel tuning.
	c.CgroupsPerQOS = false
	c.CgroupRoot = ""
	c.KubeletCgroups = ""
	c.SystemCgroups = ""
	c.EnforceNodeAllocatable = nil
	c.ProtectKernelDefaults = false
	c.ClusterDNS = nil
	// promiscuous-bridge would touch a real bridge device; hairpin-veth needs nothing here.
	c.HairpinMode = kubeletconfig.HairpinVeth
	c.EnableControllerAttachDetach = false
	// The kubelet lowers, never raises, its file limit to this; enough for one node's watches.
	c.MaxOpenFiles = 4096
	// Pods start and stop within seconds of a change, not a minute.
	c.SyncFrequency.Duration = 10 * time.Second
	c.FileCheckFrequency.Duration = 20 * time.Second
	for _, dir := range []string{s.rootDir, c.StaticPodPath, c.PodLogsDir, f.CertDirectory} {
		if err := os.MkdirAll(dir, 0o750); err != nil {
			return nil, nil, err
		}
	}
	return f, c, nil
}

func containerManager(s settings, client clientset.Interface) (cm.ContainerManager, error) {
	stub := cm.NewStubContainerManager()
	if extra := pairs("--extended-resources", s.resources); len(extra) > 0 {
		list := v1.ResourceList{}
		for name, qty := range extra {
			q, err := resource.ParseQuantity(qty)
			if err != nil {
				return nil, fmt.Errorf("--extended-resources %s=%q: %w (e.g. example.com/a=2)", name, qty, err)
			}
			list[v1.ResourceName(name)] = q
		}
		stub = cm.NewStubContainerManagerWithDevicePluginResource(list)
	}
	// The checkpoint goes in the root directory, as the real kubelet's does.
	manager, err := dra.NewManager(klog.Background(), client, s.rootDir)
	if err != nil {
		return nil, err
	}
	return &draContainerManager{ContainerManager: stub, dra: manager}, nil
}

func run(s settings) error {
	restConfig, err := clientcmd.BuildConfigFromFlags("", s.kubeconfig)
	if err != nil {
		return fmt.Errorf("--kubeconfig %s: %w", s.kubeconfig, err)
	}
	restConfig.UserAgent = "hollow-node"
	client, err := clientset.NewForConfig(restConfig)
	if err != nil {
		return err
	}

	runtimeSocket := filepath.Join(s.rootDir, "fake-cri.sock")
	_ = os.Remove(runtimeSocket) // left by a killed predecessor with the same root
	runtimeEndpoint := "unix://" + runtimeSocket
	flags, kubeletConfig, err := kubeletSettings(s, runtimeEndpoint)
	if err != nil {
		return err
	}

	// Heartbeats (node status, lease) must never wait behind the client's rate limit, and time out
	// before the lease would expire; the kubelet's own server does the same.
	heartbeatConfig := *restConfig
	heartbeatConfig.QPS = -1
	heartbeatConfig.Timeout = min(kubeletConfig.NodeStatusUpdateFrequency.Duration,
		time.Duration(kubeletConfig.NodeLeaseDurationSeconds)*time.Second)
	heartbeatClient, err := clientset.NewForConfig(&heartbeatConfig)
	if err != nil {
		return err
	}

	fakeRuntime := fakeremote.NewFakeRemoteRuntime()
	if err := fakeRuntime.Start(runtimeEndpoint); err != nil {
		return fmt.Errorf("fake CRI runtime at %s: %w", runtimeEndpoint, err)
	}
	defer fakeRuntime.Stop()
	runtimeService, err := newRuntimeService(runtimeEndpoint)
	if err != nil {
		return err
	}

	manager, err := containerManager(s, client)
	if err != nil {
		return err
	}
	klog.InfoS("hollow node", "node", s.nodeName, "rootDir", s.rootDir,
		"pluginRegistry", filepath.Join(s.rootDir, "plugins_registry"))
	kubelet := kubemark.NewHollowKubelet(flags, kubeletConfig, client, heartbeatClient,
		&cadvisortest.Fake{NodeName: s.nodeName}, fakeRuntime.ImageService, runtimeService, manager)
	publishEvents(kubelet, client)
	kubelet.Run(context.Background()) // blocks
	return nil
}

// publishEvents gives the kubelet a real event recorder when it can have one, so that its pod
// events (FailedPrepareDynamicResources with the driver's reason, ...) reach the API as on a
// real node. kubemark keeps a FakeRecorder (pkg/kubemark/hollow_kubelet.go:114) because with any
// other recorder the kubelet's OOM watcher opens /dev/kmsg (pkg/kubelet/oom/oom_watcher_linux.go:
// 51-58) and the kubelet fails to start where that is not readable; keep kubemark's then.
func publishEvents(kubelet *kubemark.HollowKubelet, client *clientset.Clientset) {
	kmsg, err := os.Open("/dev/kmsg")
	if err != nil {
		klog.InfoS("kubelet events stay local: /dev/kmsg is not readable", "err", err)
		return
	}
	_ = kmsg.Close()
	// Left nil, RunKubelet makes the kubelet's own recorder, sending to EventClient.
	kubelet.KubeletDeps.Recorder = nil
	kubelet.KubeletDeps.EventClient = client.CoreV1()
}

func main() {
	if err := run(parseSettings()); err != nil {
		fmt.Fprintln(os.Stderr, "hollow-node:", err)
		os.Exit(1)
	}
}
