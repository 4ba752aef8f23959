"""The image `make image` builds (scripts/image: the Dockerfile under buildah on a Debian-made Python base),
checked from its OCI archive, not from what the build says about it: the archive is read with tarfile, the
config and index parsed here, the layers unpacked into a directory and the command line started in it with
chroot as user 65532 (no buildah involved in the check).

Where buildah is installed the archive is (re)built first: `scripts/image build operator` is cached by the
build's content, so this costs seconds unless the sources changed. Without buildah an archive already built
is checked; with neither the tests skip, saying so.
"""

from __future__ import annotations

import gzip
import io
import json
import os
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest
import yaml

REPO_ROOT = Path(__file__).resolve().parents[2]
SCRIPT = REPO_ROOT / "scripts" / "image"
ARCHIVE = REPO_ROOT / "build" / "image" / "mig-operator.oci.tar"
WORKLOAD_ARCHIVE = REPO_ROOT / "build" / "image" / "mig-operator-workload.oci.tar"
# The name the chart's default values pull (repository mig-operator, the chart's appVersion as tag), as
# the CRI names it; the node suite reads it from `scripts/image env`.
APP_VERSION = yaml.safe_load((REPO_ROOT / "helm" / "mig-operator" / "Chart.yaml").read_text())["appVersion"]
NAME = f"docker.io/library/mig-operator:{APP_VERSION}"
WORKLOAD_NAME = "docker.io/library/mig-operator-workload:dev"
SHIM = "usr/local/lib/mig-operator/libgpuslice.so"


def built(target: str, archive: Path) -> Path:
    if shutil.which("buildah"):
        result = subprocess.run([str(SCRIPT), "build", target], capture_output=True, text=True, timeout=1800)
        assert result.returncode == 0, result.stderr[-4000:]
    elif not archive.is_file():
        pytest.skip(f"no buildah and no {archive.relative_to(REPO_ROOT)}: run `make image` to build it")
    return archive


class Image:
    """An OCI archive read directly: its index, manifest, config and layers."""

    def __init__(self, path: Path) -> None:
        self.tar = tarfile.open(path)
        self.index = json.loads(self.blob_at("index.json"))
        [self.entry] = self.index["manifests"]
        self.manifest = json.loads(self.blob(self.entry["digest"]))
        self.config = json.loads(self.blob(self.manifest["config"]["digest"]))

    def blob_at(self, name: str) -> bytes:
        member = next(m for m in self.tar.getmembers() if m.name.removeprefix("./") == name)
        return self.tar.extractfile(member).read()

    def blob(self, digest: str) -> bytes:
        return self.blob_at("blobs/" + digest.replace(":", "/"))

    def layers(self) -> list[tarfile.TarFile]:
        out = []
        for layer in self.manifest["layers"]:
            data = self.blob(layer["digest"])
            if layer["mediaType"].endswith("+gzip"):
                data = gzip.decompress(data)
            out.append(tarfile.open(fileobj=io.BytesIO(data)))
        return out

    def unpack(self, root: Path) -> None:
        """The layers applied in order, OCI whiteouts honoured (`.wh.NAME` deletes NAME)."""
        for layer in self.layers():
            members = []
            for member in layer.getmembers():
                parent, _, base = member.name.rpartition("/")
                if base == ".wh..wh..opq":
                    for child in (root / parent).glob("*"):
                        shutil.rmtree(child) if child.is_dir() and not child.is_symlink() else child.unlink()
                elif base.startswith(".wh."):
                    gone = root / parent / base.removeprefix(".wh.")
                    if gone.is_dir() and not gone.is_symlink():
                        shutil.rmtree(gone)
                    elif gone.exists() or gone.is_symlink():
                        gone.unlink()
                elif not member.isdev():
                    members.append(member)
            layer.extractall(root, members=members, numeric_owner=True, filter="fully_trusted")


@pytest.fixture(scope="module")
def image() -> Image:
    return Image(built("operator", ARCHIVE))


def test_the_archive_names_the_image_for_containerd(image: Image) -> None:
    annotations = image.entry["annotations"]
    # `ctr images import` keeps io.containerd.image.name as is; the OCI ref name for other tools.
    assert annotations["io.containerd.image.name"] == NAME
    assert annotations["org.opencontainers.image.ref.name"] == NAME
    assert image.config["os"] == "linux" and image.config["architecture"] == "amd64"


def test_the_config_runs_mig_operator_as_65532(image: Image) -> None:
    config = image.config["config"]
    assert config["User"] == "65532:65532"
    assert config["Entrypoint"] == ["mig-operator"]
    assert config["Cmd"] == ["--help"]
    assert any(e.startswith("PATH=/opt/mig-operator/bin:") for e in config["Env"])


def test_the_shim_is_at_the_path_the_chart_copies_from(image: Image) -> None:
    # The chart's init container copies this path; the last layer holding it wins.
    holders = [layer for layer in image.layers() if SHIM in {m.name.removeprefix("./") for m in layer}]
    assert holders, f"{SHIM} is in no layer"
    member = holders[-1].getmember(next(n for n in holders[-1].getnames() if n.removeprefix("./") == SHIM))
    assert member.mode & 0o004, "the shim must be readable by every user (it is preloaded into tenants' processes)"
    assert holders[-1].extractfile(member).read(4) == b"\x7fELF"
    assert SHIM.split("/", 1)[1] in (REPO_ROOT / "helm" / "mig-operator" / "templates" / "agent.yaml").read_text()


def test_no_layer_holds_a_ca_this_machine_added(image: Image) -> None:
    """The build's RUN steps trust this machine's CAs (its TLS-inspecting proxy's, for pip) through a
    bind mount; none of them may end up in the image users run."""
    added = [path for path in Path("/usr/local/share/ca-certificates").glob("**/*.crt")]
    if not added:
        pytest.skip("this machine trusts no CA of its own (/usr/local/share/ca-certificates is empty)")
    bodies = {path.name: "".join(line for line in path.read_text().splitlines() if not line.startswith("-----"))
              for path in added}
    for layer in image.layers():
        for member in layer:
            if member.isfile() and member.name.endswith((".crt", ".pem")):
                text = layer.extractfile(member).read().decode(errors="replace").replace("\n", "")
                leaked = [name for name, body in bodies.items() if body and body in text]
                assert not leaked, f"{member.name} holds this machine's CA(s) {leaked}"


@pytest.mark.skipif(os.geteuid() != 0, reason="starting the unpacked image with chroot needs root")
def test_the_unpacked_image_starts_as_its_user(image: Image, tmp_path: Path) -> None:
    root = tmp_path / "rootfs"
    root.mkdir()
    image.unpack(root)
    user = image.config["config"]["User"]
    env = dict(e.split("=", 1) for e in image.config["config"]["Env"])
    for args in ([], ["controller"], ["agent"]):
        result = subprocess.run(["chroot", f"--userspec={user}", str(root), *image.config["config"]["Entrypoint"],
                                 *args, "--help"], capture_output=True, text=True, timeout=120, env=env)
        assert result.returncode == 0, result.stderr[-3000:]
        assert result.stdout.startswith("usage: mig-operator"), result.stdout[:300]
    whoami = subprocess.run(["chroot", f"--userspec={user}", str(root), "python3", "-c",
                             "import os; print(os.getuid(), os.getgid())"],
                            capture_output=True, text=True, timeout=60, env=env)
    assert whoami.stdout.split() == ["65532", "65532"], whoami.stderr


def test_the_workload_image_holds_python_and_the_fake_libraries() -> None:
    workload = Image(built("workload", WORKLOAD_ARCHIVE))
    assert workload.entry["annotations"]["io.containerd.image.name"] == WORKLOAD_NAME
    assert workload.config["config"]["User"] == "65532:65532"
    names = {m.name.removeprefix("./") for layer in workload.layers() for m in layer}
    assert {"opt/fake-cuda/libcuda.so.1", "opt/fake-cuda/libnvidia-ml.so.1", "usr/bin/python3"} <= names
