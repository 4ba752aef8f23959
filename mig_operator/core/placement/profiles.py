"""MIG profiles and the GPU models that offer them.

A GPU's memory is a line of *memory slots* (8 on A100/H100/H200, 4 on A30). Each GPU instance
profile spans a fixed number of slots and may start only at the legal placements NVML lists
(``nvmlDeviceGetGpuInstancePossiblePlacements_v2``). A profile's memory is the ``memorySizeMB``
(MiB) NVML reports, not the number in its name.

The built-in catalog below is the simulator's truth and a fallback; at run time the agent reads
profiles and placements from NVML, because names and sizes drift between drivers and boards
(mig-parted #31, #227; nos #51). Sources are cited per table.

The catalog also holds GPUs without MIG (L4, L40S, A10, T4), which serve fractions only: they have
no profiles and no memory slots, and NVML answers their MIG queries with NOT_SUPPORTED.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from ..requests.quantities import clip_repr


class CatalogError(ValueError):
    """An unknown GPU model or profile; the message lists what is known."""


@dataclass(frozen=True, order=True)
class Placement:
    """``size`` memory slots starting at slot ``start``, as NVML's ``nvmlGpuInstancePlacement_t``."""

    start: int
    size: int

    @property
    def mask(self) -> int:
        """The slots as a bit mask: bit i set means slot i is covered."""
        return ((1 << self.size) - 1) << self.start


@dataclass(frozen=True)
class Profile:
    """A GPU instance profile: ``nvmlGpuInstanceProfileInfo_t`` plus its legal placements."""

    name: str
    id: int
    slices: int
    memory_mib: int
    sm: int
    max_instances: int
    placements: tuple[Placement, ...]

    @property
    def size(self) -> int:
        """Memory slots one instance spans; 0 for a profile NVML lists with no legal placement."""
        return self.placements[0].size if self.placements else 0

    @property
    def media_extension(self) -> bool:
        """``+me``/``-me``/``+gfx`` variants: singletons with extra engines, chosen only by name."""
        return "+" in self.name or "-me" in self.name


@dataclass(frozen=True)
class GpuModel:
    """A board: its memory slots, total memory (MiB, as NVML reports it) and MIG profiles.

    A GPU without MIG has no profiles and no memory slots (``mig_capable`` is False).
    """

    name: str
    product: str
    memory_slots: int
    memory_mib: int
    profiles: tuple[Profile, ...]
    _by_name: dict[str, Profile] = field(init=False, repr=False, compare=False, hash=False)
    _by_id: dict[int, Profile] = field(init=False, repr=False, compare=False, hash=False)
    _hash: int = field(init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_by_name", {p.name: p for p in self.profiles})
        object.__setattr__(self, "_by_id", {p.id: p for p in self.profiles})
        # The planner caches on the model; hash the profile table once, not on every lookup.
        object.__setattr__(self, "_hash", hash((self.name, self.memory_slots, self.memory_mib, self.profiles)))

    def __hash__(self) -> int:
        return self._hash

    def profile(self, name: str) -> Profile:
        try:
            return self._by_name[name]
        except KeyError:
            known = ", ".join(p.name for p in self.profiles)
            raise CatalogError(f"profile {name!r} does not exist on {self.name}; known: {known}") from None

    def profile_by_id(self, profile_id: int) -> Profile:
        try:
            return self._by_id[profile_id]
        except KeyError:
            known = ", ".join(f"{p.id} ({p.name})" for p in self.profiles)
            raise CatalogError(f"profile id {profile_id} does not exist on {self.name}; known: {known}") from None

    def has_profile(self, name: str) -> bool:
        return name in self._by_name

    @property
    def full_mask(self) -> int:
        return (1 << self.memory_slots) - 1

    @property
    def mig_capable(self) -> bool:
        return bool(self.profiles)


def _starts(starts: tuple[int, ...], size: int) -> tuple[Placement, ...]:
    return tuple(Placement(s, size) for s in starts)


def _eight_slot_model(
    name: str, product: str, memory_mib: int, mib: dict[str, int], sm: dict[str, int], names: dict[str, str]
) -> GpuModel:
    """The profile layout every 8-slot board (A100, H100, H200) shares; ids are NVML's on these boards."""
    ones = (0, 1, 2, 3, 4, 5, 6)
    return GpuModel(
        name=name,
        product=product,
        memory_slots=8,
        memory_mib=memory_mib,
        profiles=(
            Profile(names["1g"], 19, 1, mib["1g"], sm["1g"], 7, _starts(ones, 1)),
            Profile(names["1g"] + "+me", 20, 1, mib["1g"], sm["1g"], 1, _starts(ones, 1)),
            Profile(names["1g2"], 15, 1, mib["2g"], sm["1g2"], 4, _starts((0, 2, 4, 6), 2)),
            Profile(names["2g"], 14, 2, mib["2g"], sm["2g"], 3, _starts((0, 2, 4), 2)),
            Profile(names["3g"], 9, 3, mib["4g"], sm["3g"], 2, _starts((0, 4), 4)),
            Profile(names["4g"], 5, 4, mib["4g"], sm["4g"], 1, _starts((0,), 4)),
            Profile(names["7g"], 0, 7, mib["7g"], sm["7g"], 1, _starts((0,), 8)),
        ),
    )


_A100_SM = {"1g": 14, "1g2": 14, "2g": 28, "3g": 42, "4g": 56, "7g": 98}
_HOPPER_SM = {"1g": 16, "1g2": 26, "2g": 32, "3g": 60, "4g": 64, "7g": 132}

CATALOG: dict[str, GpuModel] = {
    # A real NVML capture of an H200 141GB, driver 580.159.04.
    "h200-141gb": _eight_slot_model(
        "h200-141gb", "NVIDIA H200", 143771,
        {"1g": 16384, "2g": 33280, "4g": 71424, "7g": 143360}, _HOPPER_SM,
        {"1g": "1g.18gb", "1g2": "1g.35gb", "2g": "2g.35gb", "3g": "3g.71gb", "4g": "4g.71gb", "7g": "7g.141gb"},
    ),
    # A real NVML capture of an H100 80GB HBM3, driver 580.159.04.
    "h100-80gb": _eight_slot_model(
        "h100-80gb", "NVIDIA H100 80GB HBM3", 81559,
        {"1g": 9984, "2g": 20096, "4g": 40448, "7g": 81152}, _HOPPER_SM,
        {"1g": "1g.10gb", "1g2": "1g.20gb", "2g": "2g.20gb", "3g": "3g.40gb", "4g": "4g.40gb", "7g": "7g.80gb"},
    ),
    # H100 NVL 94GB: `nvidia-smi mig -lgip` quoted in NVIDIA/gpu-operator PR #900 and mig-parted PR #101
    # (1g 10.75 GiB, 1g.24gb/2g 21.62 GiB, 3g/4g 46.38 GiB). The 7g size is not in those captures:
    # 95232 MiB follows the 3g/4g-to-7g step of the other Hopper boards (two halves plus 256 MiB).
    "h100-94gb": _eight_slot_model(
        "h100-94gb", "NVIDIA H100 NVL", 95830,
        {"1g": 11008, "2g": 22144, "4g": 47488, "7g": 95232}, _HOPPER_SM,
        {"1g": "1g.12gb", "1g2": "1g.24gb", "2g": "2g.24gb", "3g": "3g.47gb", "4g": "4g.47gb", "7g": "7g.94gb"},
    ),
    # A100 80GB: NVIDIA MIG User Guide, "A100 MIG profiles" table, with MiB from `nvidia-smi mig -lgip`
    # (9.50, 19.50, 39.25, 79.00 GiB; 2g.20gb = 19968 MiB also seen in nvitop PR #8).
    "a100-80gb": _eight_slot_model(
        "a100-80gb", "NVIDIA A100-SXM4-80GB", 81920,
        {"1g": 9728, "2g": 19968, "4g": 40192, "7g": 80896}, _A100_SM,
        {"1g": "1g.10gb", "1g2": "1g.20gb", "2g": "2g.20gb", "3g": "3g.40gb", "4g": "4g.40gb", "7g": "7g.80gb"},
    ),
    # A100 40GB: `nvidia-smi mig -lgip` on an A100-SXM4-40GB as the NVIDIA MIG User Guide prints it
    # ("Getting Started with MIG", "List GPU Instance Profiles"): 1g.5gb 4.75 GiB, 1g.10gb and 2g.10gb
    # 9.75 GiB (9984 MiB, not 9856), 3g/4g 19.62 GiB, 7g.40gb 39.50 GiB; the same table is quoted in
    # public nvidia-smi captures. Total 40960 MiB (modal-labs/modal-client PR #2797).
    "a100-40gb": _eight_slot_model(
        "a100-40gb", "NVIDIA A100-SXM4-40GB", 40960,
        {"1g": 4864, "2g": 9984, "4g": 20096, "7g": 40448}, _A100_SM,
        {"1g": "1g.5gb", "1g2": "1g.10gb", "2g": "2g.10gb", "3g": "3g.20gb", "4g": "4g.20gb", "7g": "7g.40gb"},
    ),
    # A30 24GB, 4 memory slots: NVIDIA MIG User Guide, "A30 MIG profiles" table (5.81, 11.69, 23.44 GiB).
    "a30-24gb": GpuModel(
        name="a30-24gb",
        product="NVIDIA A30",
        memory_slots=4,
        memory_mib=24576,
        profiles=(
            Profile("1g.6gb", 14, 1, 5952, 14, 4, _starts((0, 1, 2, 3), 1)),
            Profile("1g.6gb+me", 21, 1, 5952, 14, 1, _starts((0, 1, 2, 3), 1)),
            Profile("2g.12gb", 5, 2, 11968, 28, 2, _starts((0, 2), 2)),
            Profile("2g.12gb+me", 6, 2, 11968, 28, 1, _starts((0, 2), 2)),
            Profile("4g.24gb", 0, 4, 24000, 56, 1, _starts((0,), 4)),
        ),
    ),
    # GPUs without MIG, for fractions. Total memory is NVML's (nvmlDeviceGetMemoryInfo().total, what
    # `nvidia-smi` prints as MiB); all four figures are in the list of `nvidia-smi` totals in
    # modal-labs/modal-client PR #2797, and three are also cited below from captures of their own.
    # Product names as NVML prints them.
    # L4: 23034 MiB (that PR).
    "l4-24gb": GpuModel(name="l4-24gb", product="NVIDIA L4", memory_slots=0, memory_mib=23034, profiles=()),
    # L40S: `nvidia-smi --query-gpu=name,memory.total` gives "NVIDIA L40S, 46068 MiB"
    # (akash-network/provider-configs PR #99, driver 595.71.05).
    "l40s-48gb": GpuModel(name="l40s-48gb", product="NVIDIA L40S", memory_slots=0, memory_mib=46068, profiles=()),
    # A10: NVML memoryInfo.total 24146608128 bytes = 23028 MiB for "NVIDIA A10" (mayooot/detect-gpu #3,
    # driver 535.129.03).
    "a10-24gb": GpuModel(name="a10-24gb", product="NVIDIA A10", memory_slots=0, memory_mib=23028, profiles=()),
    # T4: `nvidia-smi` shows "Tesla T4 ... 15360MiB" (aws/sagemaker-huggingface-inference-toolkit PR #103,
    # driver 535.54.03).
    "t4-16gb": GpuModel(name="t4-16gb", product="Tesla T4", memory_slots=0, memory_mib=15360, profiles=()),
}


def get_model(name: str) -> GpuModel:
    """The catalog entry for ``name`` (``h200-141gb``), or a CatalogError listing the known ones."""
    try:
        return CATALOG[name]
    except (KeyError, TypeError):
        raise CatalogError(f"unknown GPU model {clip_repr(name)}; known: {', '.join(sorted(CATALOG))}") from None


def _tokens(text: str) -> list[str]:
    return re.findall(r"[a-z0-9]+", text.lower())


def model_for_product(product: str, memory_mib: int) -> GpuModel | None:
    """The catalog entry for an NVML product name and total memory, when one matches.

    The model's family (``a100``, ``l4``, ``t4``) must be a whole word of the product name, so ``L4``
    never matches ``NVIDIA L40S`` nor ``A10`` an ``A100``; the memory must be within 5 %.
    """
    words = set(_tokens(product))
    for model in CATALOG.values():
        family = model.name.split("-")[0]
        if family in words and abs(model.memory_mib - memory_mib) <= model.memory_mib // 20:
            return model
    return None
