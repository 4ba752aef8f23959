"""The seed platforms' own request examples, verbatim, each under its source: the unit tests of
core/requests/compat.py and the end-to-end tests of the compat webhook entry use the same text."""

# https://github.com/NVIDIA/KAI-Scheduler/blob/main/docs/gpu-sharing/gpu-sharing.yaml
KAI_GPU_SHARING = """
# Copyright 2025 NVIDIA CORPORATION
# SPDX-License-Identifier: Apache-2.0

apiVersion: v1
kind: Pod
metadata:
  name: gpu-sharing
  labels:
    kai.scheduler/queue: default-queue
  annotations:
    gpu-fraction: "0.5"
spec:
  schedulerName: kai-scheduler
  containers:
    - name: gpu-workload
      image: nvidia/cuda:13.0.2-base-ubi8
      command: ["nvidia-smi"]
      args: ["-L"]
"""

# https://github.com/NVIDIA/KAI-Scheduler/blob/main/docs/gpu-sharing/gpu-memory.yaml
KAI_GPU_MEMORY = """
# Copyright 2025 NVIDIA CORPORATION
# SPDX-License-Identifier: Apache-2.0

apiVersion: v1
kind: Pod
metadata:
  name: gpu-sharing
  labels:
    kai.scheduler/queue: default-queue
  annotations:
    gpu-memory: "2000" # in Mib
spec:
  schedulerName: kai-scheduler
  containers:
    - name: gpu-workload
      image: nvidia/cuda:13.0.2-base-ubi8
      command: ["nvidia-smi"]
      args: ["-L"]
"""

# https://github.com/NVIDIA/KAI-Scheduler/blob/main/docs/gpu-sharing/gpu-sharing-non-default-container.yaml
KAI_NON_DEFAULT_CONTAINER = """
# Copyright 2025 NVIDIA CORPORATION
# SPDX-License-Identifier: Apache-2.0

apiVersion: v1
kind: Pod
metadata:
  name: gpu-sharing-non-default
  labels:
    kai.scheduler/queue: default-queue
  annotations:
    gpu-fraction: "0.5"
    # Specify which container should receive the GPU fraction allocation
    # By default, the first container (index 0) receives the GPU allocation
    # Use this annotation to specify a different container by name
    gpu-fraction-container-name: "gpu-workload"
spec:
  schedulerName: kai-scheduler
  containers:
    - name: sidecar
      image: busybox
      args: ["sleep", "infinity"]
    - name: gpu-workload
      image: nvidia/cuda:13.0.2-base-ubi8
      command: ["nvidia-smi"]
      args: ["-L"]
    - name: another-sidecar
      image: busybox
      args: ["sleep", "infinity"]
"""

# https://run-ai-docs.nvidia.com/self-hosted/platform-management/runai-scheduler/scheduling/default-scheduler
RUNAI_MULTI_FRACTIONAL = """
apiVersion: v1
kind: Pod
metadata:
  annotations:
    user: test
    gpu-fraction: "0.5"
    gpu-fraction-num-devices: "2"
  labels:
    runai/queue: test
  name: multi-fractional-pod-job
  namespace: test
spec:
  containers:
  - image: gcr.io/run-ai-demo/quickstart-cuda
    imagePullPolicy: Always
    name: job
    env:
    - name: RUNAI_VERBOSE
      value: "1"
    resources:
      limits:
        cpu: 200m
        memory: 200Mi
      requests:
        cpu: 100m
        memory: 100Mi
    securityContext:
      capabilities:
        drop: ["ALL"]
  schedulerName: runai-scheduler
  serviceAccount: default
  serviceAccountName: default
  terminationGracePeriodSeconds: 5
"""

# ClearML's Fractional GPU Injector queue template with nvidia.com/gpu and clear.ml/fraction-1 ("Non-MIG
# Devices"), https://github.com/clearml/clearml-docs/blob/094aac99992fad43862fc5902b101417975be8a3/docs/clearml_agent/clearml_agent_fractional_gpus.md
CLEARML_INJECTOR_QUEUES = """
agentk8sglue:
  queues:
    default0500:
      templateOverrides:
        labels:
          required-resources: "0.5"
          clearml-injector/fraction: "0.500"
        resources:
          limits:
            nvidia.com/gpu: 1
            clear.ml/fraction-1: "0.5"
      queueSettings:
        maxPods: 10
    default0250:
      templateOverrides:
        labels:
          required-resources: "0.25"
          clearml-injector/fraction: "0.250"
        resources:
          limits:
            nvidia.com/gpu: 1
            clear.ml/fraction-1: "0.25"
      queueSettings:
        maxPods: 10
"""

# The injector >= 1.3.0 (labels only) and < 1.3.0 (nvidia.com/gpu = 8 x the share), "ClearML Agent
# Configuration", https://github.com/clearml/clearml-docs/blob/main/docs/clearml_agent/fractional_gpus/cfgi.md
CLEARML_INJECTOR_QUEUES_1_3 = """
agentk8sglue:
  createQueues: true
  queues:
    gpu-fraction-1_000:
      templateOverrides:
        labels:
          clearml-injector/fraction: "1.000"
    gpu-fraction-0_500:
      templateOverrides:
        labels:
          clearml-injector/fraction: "0.500"
    gpu-fraction-0_250:
      templateOverrides:
        labels:
          clearml-injector/fraction: "0.250"
    gpu-fraction-0_125:
      templateOverrides:
        labels:
          clearml-injector/fraction: "0.125"
"""
CLEARML_INJECTOR_QUEUES_LEGACY = """
agentk8sglue:
  createQueues: true
  queues:
    gpu-fraction-1_000:
      templateOverrides:
        resources:
          limits:
            nvidia.com/gpu: 8
    gpu-fraction-0_500:
      templateOverrides:
        labels:
          clearml-injector/fraction: "0.500"
        resources:
          limits:
            nvidia.com/gpu: 4
    gpu-fraction-0_250:
      templateOverrides:
        labels:
          clearml-injector/fraction: "0.250"
        resources:
          limits:
            nvidia.com/gpu: 2
    gpu-fraction-0_125:
      templateOverrides:
        labels:
          clearml-injector/fraction: "0.125"
        resources:
          limits:
            nvidia.com/gpu: 1
"""

# ClearML's CDMO (MIG) queue templates, "Assigning MIG Profiles to Workloads",
# https://github.com/clearml/clearml-docs/blob/main/docs/clearml_agent/fractional_gpus/cdmo.md
CLEARML_CDMO_QUEUES = """
agentk8sglue:
  queues:
    slice-1:
      templateOverrides:
        resources:
          limits:
            nvidia.com/mig-1g.10gb: "1"

    slice-2:
      templateOverrides:
        resources:
          limits:
            nvidia.com/mig-2g.20gb: "1"

    slice-4:
      templateOverrides:
        resources:
          limits:
            nvidia.com/mig-4g.40gb: "1"

    slice-7:
      templateOverrides:
        resources:
          limits:
            nvidia.com/mig-7g.80gb: "1"
"""

# The older CDMO template's queue default025 (its page's YAML is mis-indented above this block; the
# block itself is verbatim), https://github.com/clearml/clearml-docs/blob/094aac99992fad43862fc5902b101417975be8a3/docs/clearml_agent/clearml_agent_fractional_gpus.md
CLEARML_CDMO_DEFAULT025 = """
      templateOverrides:
        labels:
          required-resources: "0.25"
        resources:
          limits:
            nvidia.com/mig-1g.10gb: 1
"""


