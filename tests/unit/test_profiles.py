import pytest

from mig_operator.core.profiles import CATALOG, CatalogError, get_model, model_for_product

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


@pytest.mark.parametrize("name", sorted(CATALOG))
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
        ("NVIDIA L4", 23034, None),
    ],
)
def test_model_for_product(product: str, mib: int, expected: str | None) -> None:
    found = model_for_product(product, mib)
    assert (found.name if found else None) == expected
