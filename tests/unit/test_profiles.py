import pytest

from mig_operator.core.placement.profiles import CATALOG, CatalogError, Profile, get_model, model_for_product

MIG_MODELS = sorted(name for name, model in CATALOG.items() if model.profiles)

# The real H200 capture (shared/refs/h200-nvml-capture.md), spelled out once more as the oracle.
H200_CAPTURE = {
    # name: (id, instances, memorySizeMB, SM, starts, size)
    "1g.18gb": (19, 7, 16384, 16, (0, 1, 2, 3, 4, 5, 6), 1),
    "1g.18gb+me": (20, 1, 16384, 16, (0, 1, 2, 3, 4, 5, 6), 1),
    "1g.35gb": (15, 4, 33280, 26, (0, 2, 4, 6), 2),
    "2g.35gb": (14, 3, 33280, 32, (0, 2, 4), 2),
    "3g.71gb": (9, 2, 71424, 60, (0, 4), 4),
    "4g.71gb": (5, 1, 71424, 64, (0,), 4),
    "7g.141gb": (0, 1, 143360, 132, (0,), 8),
}


def test_h200_matches_the_real_capture() -> None:
    model = get_model("h200-141gb")
    assert {p.name for p in model.profiles} == set(H200_CAPTURE)
    for name, (pid, count, mib, sm, starts, size) in H200_CAPTURE.items():
        p = model.profile(name)
        assert (p.id, p.max_instances, p.memory_mib, p.sm, p.size) == (pid, count, mib, sm, size)
        assert tuple(pl.start for pl in p.placements) == starts


def test_h100_matches_the_real_capture() -> None:
    model = get_model("h100-80gb")
    assert model.profile("1g.10gb").memory_mib == 9984
    assert model.profile("1g.20gb").id == 15
    assert model.profile("7g.80gb").memory_mib == 81152
    assert model.memory_mib == 81559


# `nvidia-smi mig -lgip` on an A100-SXM4-40GB (NVIDIA MIG User Guide, "List GPU Instance Profiles"):
# name -> (id, instances, GiB as printed with two decimals).
A100_40GB_LGIP = {
    "1g.5gb": (19, 7, 4.75),
    "1g.5gb+me": (20, 1, 4.75),
    "1g.10gb": (15, 4, 9.75),
    "2g.10gb": (14, 3, 9.75),
    "3g.20gb": (9, 2, 19.62),
    "4g.20gb": (5, 1, 19.62),
    "7g.40gb": (0, 1, 39.50),
}

# GPUs without MIG: NVML's product name and total MiB, from the captures profiles.py cites.
NO_MIG = {
    "l4-24gb": ("NVIDIA L4", 23034),
    "l40s-48gb": ("NVIDIA L40S", 46068),
    "a10-24gb": ("NVIDIA A10", 23028),
    "t4-16gb": ("Tesla T4", 15360),
}


def test_a100_40gb_matches_nvidia_smi() -> None:
    model = get_model("a100-40gb")
    assert {p.name for p in model.profiles} == set(A100_40GB_LGIP)
    for name, (pid, count, gib) in A100_40GB_LGIP.items():
        p = model.profile(name)
        assert (p.id, p.max_instances) == (pid, count)
        # nvidia-smi rounds MiB/1024 to two decimals; allow that rounding and nothing more.
        assert abs(p.memory_mib / 1024 - gib) <= 0.005, name
    assert model.profile("1g.10gb").memory_mib == model.profile("2g.10gb").memory_mib == 9984


@pytest.mark.parametrize("name", sorted(NO_MIG))
def test_gpus_without_mig(name: str) -> None:
    model = get_model(name)
    assert (model.product, model.memory_mib) == NO_MIG[name]
    assert model.profiles == () and model.memory_slots == 0 and not model.mig_capable
    assert model.full_mask == 0
    assert model_for_product(*NO_MIG[name]) is model


def test_mig_models_are_mig_capable() -> None:
    assert set(MIG_MODELS) == set(CATALOG) - set(NO_MIG)
    assert all(CATALOG[name].mig_capable for name in MIG_MODELS)


def test_a_profile_without_placements_has_size_zero() -> None:
    assert Profile("1g.1gb", 99, 1, 1024, 1, 1, ()).size == 0


@pytest.mark.parametrize("name", MIG_MODELS)
def test_every_catalog_is_consistent(name: str) -> None:
    model = CATALOG[name]
    ids = [p.id for p in model.profiles]
    assert len(ids) == len(set(ids)), "profile ids are unique per board"
    for p in model.profiles:
        assert p.max_instances >= 1
        assert p.name.startswith(f"{p.slices}g.")
        for pl in p.placements:
            assert 0 <= pl.start and pl.start + pl.size <= model.memory_slots
            assert pl.start % pl.size == 0 or pl.size == 1, "placements are aligned to their size"
        assert p.memory_mib <= model.memory_mib
    full = max(model.profiles, key=lambda p: p.size)
    assert full.size == model.memory_slots


def test_unknown_model_lists_known_ones() -> None:
    with pytest.raises(CatalogError) as info:
        get_model("h300")
    assert "'h300'" in str(info.value) and "h200-141gb" in str(info.value)


def test_unknown_model_message_quotes_at_most_about_100_characters() -> None:
    with pytest.raises(CatalogError) as info:
        get_model("z" * 5000)
    message = str(info.value)
    assert "z" * 99 in message and "z" * 101 not in message and "5000 characters" in message


def test_unknown_profile_lists_known_ones() -> None:
    with pytest.raises(CatalogError) as info:
        get_model("a30-24gb").profile("3g.12gb")
    assert "1g.6gb" in str(info.value)


@pytest.mark.parametrize(
    ("product", "mib", "expected"),
    [
        ("NVIDIA H200", 143771, "h200-141gb"),
        ("NVIDIA H100 80GB HBM3", 81559, "h100-80gb"),
        ("NVIDIA H100 NVL", 95830, "h100-94gb"),
        ("NVIDIA A100-SXM4-40GB", 40960, "a100-40gb"),
        ("NVIDIA A100-SXM4-80GB", 81920, "a100-80gb"),
        ("NVIDIA A30", 24576, "a30-24gb"),
        ("NVIDIA L4", 23034, "l4-24gb"),
        ("NVIDIA L40S", 46068, "l40s-48gb"),
        ("NVIDIA A10", 23028, "a10-24gb"),
        ("Tesla T4", 15360, "t4-16gb"),
        # The family must be a whole word: L4 is not in "L40S", A10 not in "A100".
        ("NVIDIA L40S", 23034, None),
        ("NVIDIA A100-PCIE-40GB", 23028, None),
        ("NVIDIA A10G", 22731, None),
        ("NVIDIA L4", 46068, None),
    ],
)
def test_model_for_product(product: str, mib: int, expected: str | None) -> None:
    found = model_for_product(product, mib)
    assert (found.name if found else None) == expected
