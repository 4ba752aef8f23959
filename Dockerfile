# One image for every part of mig-operator: the controller (`mig-operator controller`), the node agents
# (`mig-operator agent`) and the agents' init container that installs libgpuslice.so on the host.
#
#   docker build -t REGISTRY/mig-operator:0.1.0 .     then: helm install ... --set image.repository=REGISTRY/mig-operator
#
# Without Docker or a registry: `make image` (scripts/image) builds this file with buildah on a Python
# base made from Debian's packages, passed as PYTHON_IMAGE, into an OCI archive (docs/control-plane.md).
#
# Base: the official python:3.11-slim-bookworm multi-platform index, pinned by digest. The digest is
# the one Docker Hub's tag API and `docker buildx imagetools inspect python:3.11-slim-bookworm`
# reported for that tag (Python 3.11.16) in late September 2026, as recorded independently in several
# public repositories' Dockerfiles and build notes (found through a code search; no image can be pulled
# where this file was written). To move to a newer patch release, resolve the tag again with
# `docker buildx imagetools inspect python:3.11-slim-bookworm` and replace the digest in one place.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm@sha256:a36c24f9cbdf4fd0f52d67f0823eeac19c2028c637cecc392d97f980d4fec56b

# ---- the shim (C) --------------------------------------------------------------------------------
FROM ${PYTHON_IMAGE} AS shim
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# Build tools from the base's own Debian release; versions follow the pinned base image.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev make \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY shim/ shim/
RUN make -C shim libgpuslice.so

# ---- the Python package --------------------------------------------------------------------------
FROM ${PYTHON_IMAGE} AS wheel
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
WORKDIR /src
COPY pyproject.toml ./
# A virtual environment, copied whole into the final stage, with the dependencies pyproject.toml names
# installed first, in a layer of their own: a change to the sources alone rebuilds only the next step.
RUN python -m venv /opt/mig-operator \
    && python -c 'import tomllib; print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]))' \
        > /tmp/requirements.txt \
    && /opt/mig-operator/bin/pip install -r /tmp/requirements.txt \
    && rm /tmp/requirements.txt
COPY mig_operator/ mig_operator/
# The wheel (setuptools from pyproject's build-system, in pip's isolated build environment), installed
# into the environment, whose dependencies are already there.
RUN pip wheel --no-deps --wheel-dir /wheels . \
    && /opt/mig-operator/bin/pip install /wheels/mig_operator-*.whl

# ---- the image -----------------------------------------------------------------------------------
FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="mig-operator" \
      org.opencontainers.image.description="GPU slices for Kubernetes: dynamic MIG instances or memory-limited fractions" \
      org.opencontainers.image.licenses="Apache-2.0"
ENV PATH=/opt/mig-operator/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
COPY --from=wheel /opt/mig-operator /opt/mig-operator
# The agents' init container copies this file into the host directory sliced pods mount.
COPY --from=shim /src/shim/libgpuslice.so /usr/local/lib/mig-operator/libgpuslice.so
# The image must start: the same check tests/packaging runs on the same steps outside Docker.
RUN mig-operator --help > /dev/null \
    && mig-operator controller --help > /dev/null \
    && mig-operator agent --help > /dev/null
# Non-root by default: the controller needs nothing more. The agent's pod runs it as root with
# CAP_SYS_ADMIN, because NVML's MIG create/destroy requires the driver's mig/config capability (see
# helm/mig-operator/values.yaml and docs/operations.md); the shim installer runs as root with no
# capabilities to write into a root-owned host directory.
USER 65532:65532
ENTRYPOINT ["mig-operator"]
CMD ["--help"]
