# shellcheck shell=bash
# A real node for scripts/control-plane (`build --with node`, `up --with node`): containerd 2.x with
# CDI, runc, the CNI bridge/loopback/host-local plugins and the kubelet of the pinned release,
# registered as a GPU-less Node of the local control plane. Sourced by scripts/control-plane, whose
# helpers (log, die, go_env, start_proc, recorded_alive, k8s_wrapper_module, ...) it uses.
#
# Everything the node writes is under $NODE_DIR (= <state dir>/node): containerd's root and state,
# the kubelet's root dir, pod logs, the CNI config, the CDI spec dirs. What it changes on the host,
# and `down` undoes: a bridge (mig-node0), one iptables NAT rule, route_localnet on that bridge,
# cgroups under kubepods/, mounts under $NODE_DIR. One node per machine (the bridge, the kubelet's
# port 10250 and the cgroup names are the host's); docs/control-plane.md lists the differences from a
# production node.

CONTAINERD_VERSION=v2.4.2
CNI_PLUGINS_VERSION=v1.10.0
PAUSE_IMAGE=registry.k8s.io/pause:3.10.1   # containerd's default sandbox image name; built here
NODE_BIN_DIR=$BIN_DIR/node
NODE_DIR=$STATE_DIR/node
NODE_NAME=${MIG_OPERATOR_NODE_NAME:-node-0}
NODE_BRIDGE=mig-node0
NODE_POD_CIDR=10.88.0.0/16
NODE_IP=10.88.0.1          # the bridge's address: the Node's InternalIP, the pods' gateway
SERVICE_IP=10.0.0.1        # the `kubernetes` Service (first address of --service-cluster-ip-range)
NODE_BINS=(containerd ctr containerd-shim-runc-v2 kubelet cni/bridge cni/loopback cni/host-local)

# ---- build -----------------------------------------------------------------------------------

# Each part is keyed by what it is made from: its pinned version (the pause image: the sha256 of
# pause.c's version and of the packer), kept next to it as <part>.key; a changed key rebuilds it.
part_key() {
    case $1 in
        containerd) echo "$CONTAINERD_VERSION" ;;
        cni) echo "$CNI_PLUGINS_VERSION" ;;
        kubelet) echo "$K8S_VERSION" ;;
        pause) echo "$K8S_VERSION $PAUSE_IMAGE $(sha256sum <"$REPO_DIR/scripts/oci-archive" | cut -d' ' -f1)" ;;
    esac
}

part_current() {   # PART: built, from what it is made from now
    [[ -f $NODE_BIN_DIR/$1.key && $(<"$NODE_BIN_DIR/$1.key") == "$(part_key "$1")" ]]
}

node_built() {
    local b p
    for b in "${NODE_BINS[@]}"; do [[ -x $NODE_BIN_DIR/$b ]] || return 1; done
    for p in containerd cni kubelet pause; do part_current "$p" || return 1; done
    [[ -f $NODE_BIN_DIR/pause.oci.tar ]] && command -v runc >/dev/null && command -v iptables >/dev/null
}

# runc and iptables are Debian's packages (the Go module of runc needs cgo and libseccomp headers).
install_node_packages() {
    command -v runc >/dev/null && command -v iptables >/dev/null && return
    log "installing runc and iptables (Debian packages)..."
    # One apt at a time on this machine (others may be installing too): wait for dpkg's lock.
    DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 update -qq >/dev/null \
        && DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y -qq \
            --no-install-recommends runc iptables >/dev/null \
        || die "apt-get install runc iptables failed (needs root and Debian's package mirror)"
}

build_containerd() {
    local go=$GO_CMD pkg=github.com/containerd/containerd/v2
    log "building containerd $CONTAINERD_VERSION, ctr, containerd-shim-runc-v2 (cold: ~6 min on 2 cores)..."
    # No cgo: the overlayfs snapshotter and the CRI plugin are pure Go; btrfs/devmapper/zfs are left out.
    (cd "$VERSION_DIR" && GOBIN=$NODE_BIN_DIR "$go" install -tags "no_btrfs no_devmapper no_zfs" \
        -ldflags "-s -w -X $pkg/version.Version=$CONTAINERD_VERSION" \
        "$pkg/cmd/containerd@$CONTAINERD_VERSION" "$pkg/cmd/ctr@$CONTAINERD_VERSION" \
        "$pkg/cmd/containerd-shim-runc-v2@$CONTAINERD_VERSION")
}

build_cni_plugins() {
    local go=$GO_CMD p=github.com/containernetworking/plugins/plugins
    log "building CNI plugins $CNI_PLUGINS_VERSION (bridge, loopback, host-local)..."
    mkdir -p "$NODE_BIN_DIR/cni"
    (cd "$VERSION_DIR" && GOBIN=$NODE_BIN_DIR/cni "$go" install -ldflags "-s -w" \
        "$p/main/bridge@$CNI_PLUGINS_VERSION" "$p/main/loopback@$CNI_PLUGINS_VERSION" \
        "$p/ipam/host-local@$CNI_PLUGINS_VERSION")
}

build_kubelet() {
    local go=$GO_CMD
    k8s_wrapper_module "$VERSION_DIR/src/kubelet-wrap"
    "$go" get "k8s.io/kubernetes/cmd/kubelet@$K8S_VERSION"
    log "building kubelet $K8S_VERSION (~3 min when the k8s build cache is warm)..."
    "$go" build -ldflags "$(k8s_ldflags)" -o "$NODE_BIN_DIR/kubelet" k8s.io/kubernetes/cmd/kubelet
}

# The sandbox ("pause") image cannot be pulled here: compile the pause program of the pinned
# Kubernetes source statically and pack it as a one-layer OCI archive under containerd's name for it.
build_pause() {
    local src tmp
    src=$GOMODCACHE/k8s.io/kubernetes@$K8S_VERSION/build/pause/linux/pause.c
    [[ -f $src ]] || "$GO_CMD" mod download "k8s.io/kubernetes@$K8S_VERSION"
    command -v gcc >/dev/null || die "gcc is needed to build the pause image (apt-get install gcc libc6-dev)"
    tmp=$(mktemp -d)
    gcc -Os -static -Wall -DVERSION="${PAUSE_IMAGE##*:}" -o "$tmp/pause" "$src"
    strip "$tmp/pause"
    "$REPO_DIR/scripts/oci-archive" "$NODE_BIN_DIR/pause.oci.tar" "$PAUSE_IMAGE" "$tmp/pause:/pause" \
        --entrypoint /pause --user 65535:65535
    rm -rf "$tmp"
}

build_node() {
    local start=$SECONDS p
    mkdir -p "$NODE_BIN_DIR"
    install_node_packages
    for p in containerd cni kubelet pause; do
        part_current "$p" && continue
        case $p in
            containerd) build_containerd ;;
            cni) build_cni_plugins ;;
            kubelet) build_kubelet ;;
            pause) build_pause ;;
        esac
        part_key "$p" >"$NODE_BIN_DIR/$p.key"
    done
    log "node parts built in $((SECONDS - start)) s; in $NODE_BIN_DIR"
}

# ---- up --------------------------------------------------------------------------------------

# Why the node cannot start here, or nothing: one line for the caller (tests skip with it).
node_preflight() {
    [[ $(id -u) == 0 ]] || { echo "a real node needs root (mounts, cgroups, network namespaces)"; return; }
    [[ -d /sys/fs/cgroup/devices || -f /sys/fs/cgroup/cgroup.controllers ]] \
        || { echo "no cgroup hierarchy at /sys/fs/cgroup"; return; }
    grep -qw overlay /proc/filesystems || { echo "the kernel has no overlay filesystem (containerd's snapshotter)"; return; }
    ip link add mig-node-probe type bridge 2>/dev/null \
        || { echo "cannot create a network bridge (no CAP_NET_ADMIN?)"; return; }
    ip link del mig-node-probe
    if ip link show "$NODE_BRIDGE" >/dev/null 2>&1; then
        echo "bridge $NODE_BRIDGE exists: another real node runs on this machine (scripts/control-plane down there)"
        return
    fi
}

write_node_config() {
    local api_port=$1 kc=$STATE_DIR/kubeconfig
    mkdir -p "$NODE_DIR"/{containerd,cni/net.d,cdi/run,cdi/etc,kubelet,pod-logs,var/lib/mig-operator}
    # The CDI dirs the chart's agent writes to and containerd reads from (agent.cdiDir; /etc/cdi's
    # stand-in for the NVIDIA toolkit's specs).
    cat >"$NODE_DIR/containerd/config.toml" <<EOF
version = 4
root = "$NODE_DIR/containerd/root"
state = "$NODE_DIR/containerd/state"

[plugins."io.containerd.server.v1.grpc"]
  address = "$NODE_DIR/containerd/containerd.sock"
[plugins."io.containerd.server.v1.ttrpc"]
  address = "$NODE_DIR/containerd/containerd.sock.ttrpc"

[plugins."io.containerd.cri.v1.runtime"]
  # CDI is always on in containerd 2.x; these are its spec dirs. Pod network namespaces live under
  # the state dir, not /run/netns, so that stopping the node finds every mount.
  netns_mounts_under_state_dir = true
  # This machine's processes lack CAP_SYS_RESOURCE (not in the bounding set): no oom_score_adj below
  # containerd's own, which the pods' negative ones (the sandbox's -998) would need.
  restrict_oom_score_adj = true
  cdi_spec_dirs = ["$NODE_DIR/cdi/etc", "$NODE_DIR/cdi/run"]
  [plugins."io.containerd.cri.v1.runtime".containerd]
    default_runtime_name = "runc"
    [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc.options]
        BinaryName = "$(command -v runc)"
        Root = "$NODE_DIR/containerd/runc"
        SystemdCgroup = false
  [plugins."io.containerd.cri.v1.runtime".cni]
    bin_dirs = ["$NODE_BIN_DIR/cni"]
    conf_dir = "$NODE_DIR/cni/net.d"

[plugins."io.containerd.cri.v1.images"]
  snapshotter = "overlayfs"
  [plugins."io.containerd.cri.v1.images".pinned_images]
    sandbox = "$PAUSE_IMAGE"
EOF
    # ipMasq off: pods talk only to this host (the API server through the NAT rule below), never out.
    cat >"$NODE_DIR/cni/net.d/10-mig-node.conflist" <<EOF
{"cniVersion": "1.0.0", "name": "mig-node", "plugins": [
  {"type": "bridge", "bridge": "$NODE_BRIDGE", "isGateway": true, "ipMasq": false,
   "ipam": {"type": "host-local", "ranges": [[{"subnet": "$NODE_POD_CIDR", "gateway": "$NODE_IP"}]],
            "dataDir": "$NODE_DIR/cni/ipam", "routes": [{"dst": "0.0.0.0/0"}]}},
  {"type": "loopback"}]}
EOF
    # failCgroupV1: this machine's cgroups are v1. Anonymous, always-allowed kubelet API: the API
    # server calls it (logs, exec) without a client certificate; it listens on the bridge only.
    cat >"$NODE_DIR/kubelet-config.yaml" <<EOF
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
failCgroupV1: false
cgroupDriver: cgroupfs
containerRuntimeEndpoint: unix://$NODE_DIR/containerd/containerd.sock
address: $NODE_IP
port: 10250
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: $(free_port)
authentication:
  anonymous: {enabled: true}
  webhook: {enabled: false}
authorization: {mode: AlwaysAllow}
podLogsDir: $NODE_DIR/pod-logs
failSwapOn: false
oomScoreAdj: 0
resolvConf: ""
registerNode: true
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
evictionHard: {memory.available: "100Mi", nodefs.available: "1%", imagefs.available: "1%"}
serializeImagePulls: false
EOF
    : "$api_port" "$kc"
}

# The pods' way to the API server: the kubernetes Service's ClusterIP (what the kubelet puts in
# KUBERNETES_SERVICE_HOST) is rewritten to the API server on 127.0.0.1, which keeps listening on
# loopback only; route_localnet lets the bridge's packets reach 127.0.0.1. No kube-proxy: this is the
# only Service a pod here needs (the API server reaches webhooks at their endpoints' IPs).
node_network_up() {
    local api_port=$1
    ip link add "$NODE_BRIDGE" type bridge
    ip addr add "$NODE_IP/${NODE_POD_CIDR#*/}" dev "$NODE_BRIDGE"
    ip link set "$NODE_BRIDGE" up
    sysctl -qw "net.ipv4.conf.$NODE_BRIDGE.route_localnet=1"
    iptables -t nat -A PREROUTING -i "$NODE_BRIDGE" -d "$SERVICE_IP/32" -p tcp --dport 443 \
        -m comment --comment "mig-operator node: kubernetes Service" -j DNAT --to-destination "127.0.0.1:$api_port"
    echo "$api_port" >"$NODE_DIR/nat-port"
}

start_node() {
    local api_port=$1 why i
    why=$(node_preflight)
    [[ -z $why ]] || fail_up "the real node cannot start here: $why"
    write_node_config "$api_port"
    # The chart's agent mounts the host's /etc/cdi (DirectoryOrCreate): remove it again if it was not here.
    [[ -e /etc/cdi ]] || touch "$NODE_DIR/etc-cdi-made"
    node_network_up "$api_port"
    log "starting containerd $CONTAINERD_VERSION (socket $NODE_DIR/containerd/containerd.sock)"
    PATH=$NODE_BIN_DIR:$PATH start_proc containerd "$NODE_BIN_DIR/containerd" \
        --config "$NODE_DIR/containerd/config.toml"
    for ((i = 0; i < 120; i++)); do
        node_ctr version >/dev/null 2>&1 && break
        recorded_alive containerd || break
        sleep 0.25
    done
    node_ctr version >/dev/null 2>&1 || { tail -30 "$STATE_DIR/logs/containerd.log" >&2; fail_up "containerd failed to start"; }
    node_ctr images import --local "$NODE_BIN_DIR/pause.oci.tar" >/dev/null \
        || fail_up "importing the pause image failed"
    start_kubelet
}

# The kubelet, then its Node Ready. Also `restart kubelet`: a kubelet restarted with pods running and
# claims prepared finds them in its checkpoints, as after a kubelet upgrade on a production node.
start_kubelet() {
    local kc=$STATE_DIR/kubeconfig i ready="" port
    log "starting kubelet as Node $NODE_NAME (root $NODE_DIR/kubelet, InternalIP $NODE_IP)"
    start_proc kubelet "$NODE_BIN_DIR/kubelet" --config="$NODE_DIR/kubelet-config.yaml" \
        --kubeconfig="$kc" --root-dir="$NODE_DIR/kubelet" --hostname-override="$NODE_NAME" \
        --node-ip="$NODE_IP" --cert-dir="$NODE_DIR/kubelet/pki"
    # A restarted kubelet's Node may still say Ready from before: its own health endpoint first.
    port=$(sed -nE 's/^healthzPort: ([0-9]+)$/\1/p' "$NODE_DIR/kubelet-config.yaml")
    for ((i = 0; i < 480; i++)); do
        [[ -n $ready ]] || { curl -sf -o /dev/null --max-time 2 "http://127.0.0.1:$port/healthz" && ready=healthy; }
        [[ -n $ready ]] && ready=$("$BIN_DIR/kubectl" --kubeconfig="$kc" get node "$NODE_NAME" \
            -o 'jsonpath={.status.conditions[?(@.type=="Ready")].status}' 2>/dev/null || echo healthy)
        [[ $ready == True ]] && return 0
        recorded_alive kubelet || break
        sleep 0.25
    done
    log "Node $NODE_NAME did not become Ready; last lines of $STATE_DIR/logs/kubelet.log:"
    tail -30 "$STATE_DIR/logs/kubelet.log" >&2
    fail_up "the kubelet failed to start"
}

# ctr against this node's containerd, in the kubelet's namespace: e.g. `node_ctr images import X.tar`.
node_ctr() {
    "$NODE_BIN_DIR/ctr" --address "$NODE_DIR/containerd/containerd.sock" --namespace k8s.io "$@"
}

# ---- down ------------------------------------------------------------------------------------

# Every process in a cgroup under kubepods/ (the kubelet's pods, with cgroupfs): the containers
# and their shims' children. Killed by pid, read from the cgroup, which only the node put there.
kill_pod_processes() {
    local f pid
    for f in /sys/fs/cgroup/pids/kubepods /sys/fs/cgroup/kubepods; do
        [[ -d $f ]] || continue
        while read -r pid; do
            [[ -n $pid ]] && kill -KILL "$pid" 2>/dev/null || true
        done < <(find "$f" -name cgroup.procs -exec cat {} + 2>/dev/null)
    done
}

# The shims of this node's containerd (their command line names its socket), by pid.
node_shims() {
    local d exe
    for d in /proc/[0-9]*; do
        exe=$(readlink "$d/exe" 2>/dev/null) || continue
        [[ $exe == "$NODE_BIN_DIR/containerd-shim-runc-v2" ]] || continue
        tr '\0' ' ' <"$d/cmdline" 2>/dev/null | grep -qF -- "$NODE_DIR/containerd/containerd.sock" \
            && echo "${d#/proc/}"
    done
}

# Their containers killed, the shims exit by themselves (removing their sockets under
# /run/containerd/s); any left after 5 s are killed.
kill_node_shims() {
    local i pid
    for ((i = 0; i < 20; i++)); do
        [[ -n $(node_shims) ]] || return 0
        sleep 0.25
    done
    for pid in $(node_shims); do kill -KILL "$pid" 2>/dev/null || true; done
}

stop_named() {   # NAME: SIGTERM, SIGKILL after 10 s (as cmd_down does for the others)
    local name=$1 pid i
    [[ -f $STATE_DIR/pids/$name ]] || return 0
    read -r pid _ <"$STATE_DIR/pids/$name"
    recorded_alive "$name" || return 0
    log "stopping $name (pid $pid)"
    kill -TERM "$pid" 2>/dev/null || true
    for ((i = 0; i < 40; i++)); do recorded_alive "$name" || break; sleep 0.25; done
    if recorded_alive "$name"; then kill -KILL "$pid" 2>/dev/null || true; fi
    rm -f "$STATE_DIR/pids/$name"
}

# Undo everything start_node did; safe to run when it did nothing or only part of it.
stop_node() {
    local m port c
    [[ -d $NODE_DIR ]] || return 0
    stop_named kubelet
    kill_pod_processes
    stop_named containerd
    kill_node_shims
    # Mounts under the node dir (container root filesystems, volumes, netns bind mounts), deepest first.
    while read -r m; do
        umount -l "$m" 2>/dev/null || true
    done < <(awk -v d="$NODE_DIR/" 'index($5, d) == 1 {print $5}' /proc/self/mountinfo | sort -r)
    if [[ -f $NODE_DIR/nat-port ]]; then
        port=$(<"$NODE_DIR/nat-port")
        iptables -t nat -D PREROUTING -i "$NODE_BRIDGE" -d "$SERVICE_IP/32" -p tcp --dport 443 \
            -m comment --comment "mig-operator node: kubernetes Service" -j DNAT --to-destination "127.0.0.1:$port" \
            2>/dev/null || true
    fi
    ip link del "$NODE_BRIDGE" 2>/dev/null || true
    [[ -f $NODE_DIR/etc-cdi-made ]] && rmdir /etc/cdi 2>/dev/null || true
    # containerd's fixed shim socket and fifo dirs, when empty (nothing else uses them then).
    rmdir /run/containerd/s /run/containerd/fifo /run/containerd/runc /run/containerd 2>/dev/null || true
    # The kubelet's cgroups (cgroupfs driver): kubepods and its QoS/pod children, leaves first.
    for c in /sys/fs/cgroup/*/kubepods; do
        [[ -d $c ]] && find "$c" -depth -type d -exec rmdir {} \; 2>/dev/null || true
    done
    rm -rf "$NODE_DIR"
}

# `restart kubelet`: stop the kubelet (pods and containerd keep running) and start it again.
restart_kubelet() {
    recorded_alive kubelet || die "restart: no kubelet of a real node runs in $STATE_DIR (up --with node first)"
    stop_named kubelet
    start_kubelet
}
