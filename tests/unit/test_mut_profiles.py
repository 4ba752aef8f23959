"""The catalog's builders against NVML captures, called at test time (mutation testing, docs/testing.md).

``CATALOG`` is built when ``profiles`` is imported, before mutmut switches a mutant on, so a test that
only reads ``CATALOG`` cannot see a mutant of ``_eight_slot_model`` or ``_starts``. These tests call
the builders themselves with a board's numbers and compare what comes out with the capture.
"""

from __future__ import annotations

import pytest

from mig_operator.core.placement.profiles import (
    CATALOG,
    CatalogError,
    GpuModel,
    Placement,
    Profile,
    _eight_slot_model,
    _starts,
    get_model,
    model_for_product,
)

# `nvidia-smi mig -lgip` and `-lgipp` on a real H200, driver 580.159.04 (shared/refs/h200-nvml-capture.md):
# name -> (id, slices, memorySizeMB, SM, instances, starts, size).
H200 = {
    "1g.18gb": (19, 1, 16384, 16, 7, (0, 1, 2, 3, 4, 5, 6), 1),
    "1g.18gb+me": (20, 1, 16384, 16, 1, (0, 1, 2, 3, 4, 5, 6), 1),
    "1g.35gb": (15, 1, 33280, 26, 4, (0, 2, 4, 6), 2),
    "2g.35gb": (14, 2, 33280, 32, 3, (0, 2, 4), 2),
    "3g.71gb": (9, 3, 71424, 60, 2, (0, 4), 4),
    "4g.71gb": (5, 4, 71424, 64, 1, (0,), 4),
    "7g.141gb": (0, 7, 143360, 132, 1, (0,), 8),
}
# The same capture's H100 80GB HBM3 table, whose sizes and names differ from the H200's in every place.
H100 = {
    "1g.10gb": (19, 1, 9984, 16, 7, (0, 1, 2, 3, 4, 5, 6), 1),
    "1g.10gb+me": (20, 1, 9984, 16, 1, (0, 1, 2, 3, 4, 5, 6), 1),
    "1g.20gb": (15, 1, 20096, 26, 4, (0, 2, 4, 6), 2),
    "2g.20gb": (14, 2, 20096, 32, 3, (0, 2, 4), 2),
    "3g.40gb": (9, 3, 40448, 60, 2, (0, 4), 4),
    "4g.40gb": (5, 4, 40448, 64, 1, (0,), 4),
    "7g.80gb": (0, 7, 81152, 132, 1, (0,), 8),
}


def _table(model: GpuModel) -> dict[str, tuple]:
    return {
        p.name: (p.id, p.slices, p.memory_mib, p.sm, p.max_instances, tuple(pl.start for pl in p.placements),
                 p.size)
        for p in model.profiles
    }


def _build(capture: dict[str, tuple], name: str, product: str, total_mib: int) -> GpuModel:
    """``_eight_slot_model`` fed with the capture's own numbers, keyed as the catalog keys them."""
    by_size = {"1g": "1g.", "1g2": None, "2g": "2g.", "3g": "3g.", "4g": "4g.", "7g": "7g."}
    names = {}
    for key, prefix in by_size.items():
        if prefix is None:  # the one-slice profile that spans two memory slots
            names[key] = next(n for n, v in capture.items() if v[1] == 1 and v[6] == 2)
        else:
            names[key] = next(n for n in capture if n.startswith(prefix) and "+" not in n)
    mib = {"1g": capture[names["1g"]][2], "2g": capture[names["2g"]][2], "4g": capture[names["4g"]][2],
           "7g": capture[names["7g"]][2]}
    sm = {key: capture[names[key]][3] for key in by_size}
    return _eight_slot_model(name, product, total_mib, mib, sm, names)


@pytest.mark.parametrize(("capture", "name", "product", "total"), [
    (H200, "h200-141gb", "NVIDIA H200", 143771),
    (H100, "h100-80gb", "NVIDIA H100 80GB HBM3", 81559),
])
def test_the_eight_slot_builder_gives_the_captured_table(capture, name, product, total) -> None:
    model = _build(capture, name, product, total)
    assert _table(model) == capture
    assert (model.name, model.product, model.memory_slots, model.memory_mib) == (name, product, 8, total)
    # In the order `nvidia-smi mig -lgip` prints them.
    assert [p.name for p in model.profiles] == list(capture)
    assert model == CATALOG[name]


@pytest.mark.parametrize("name", ["h200-141gb", "h100-80gb"])
def test_the_catalog_holds_the_captured_tables(name) -> None:
    assert _table(CATALOG[name]) == {"h200-141gb": H200, "h100-80gb": H100}[name]


def test_starts_gives_one_placement_per_start_of_the_given_size() -> None:
    assert _starts((0, 2, 4, 6), 2) == (Placement(0, 2), Placement(2, 2), Placement(4, 2), Placement(6, 2))
    assert _starts((), 4) == ()


def test_placement_masks_cover_exactly_their_slots() -> None:
    for start in range(8):
        for size in range(1, 9 - start):
            expected = sum(1 << slot for slot in range(start, start + size))
            assert Placement(start, size).mask == expected


def test_media_extension_is_known_by_name() -> None:
    def named(name: str) -> Profile:
        return Profile(name, 1, 1, 1, 1, 1, (Placement(0, 1),))

    assert [named(n).media_extension for n in ("1g.18gb+me", "1g.18gb-me", "1g.18gb+gfx", "1g.18gb+me.all")] == [
        True, True, True, True]
    assert [named(n).media_extension for n in ("1g.18gb", "2g.35gb", "7g.141gb")] == [False, False, False]


def test_a_model_looks_profiles_up_by_name_and_id() -> None:
    model = get_model("a30-24gb")
    assert model.profile("2g.12gb+me").id == 6
    assert model.profile_by_id(6).name == "2g.12gb+me"
    assert model.has_profile("4g.24gb") and not model.has_profile("4g.24gb+me")
    assert model.full_mask == 0b1111 and get_model("h200-141gb").full_mask == 0xFF
    with pytest.raises(CatalogError) as info:
        model.profile_by_id(9)
    message = str(info.value)
    assert "profile id 9 does not exist on a30-24gb" in message
    assert "14 (1g.6gb), 21 (1g.6gb+me), 5 (2g.12gb), 6 (2g.12gb+me), 0 (4g.24gb)" in message
    with pytest.raises(CatalogError) as info:
        model.profile("3g.12gb")
    assert str(info.value) == (
        "profile '3g.12gb' does not exist on a30-24gb; known: 1g.6gb, 1g.6gb+me, 2g.12gb, 2g.12gb+me, 4g.24gb")


def test_equal_models_hash_alike() -> None:
    model = get_model("h100-94gb")
    copy = GpuModel(model.name, model.product, model.memory_slots, model.memory_mib, model.profiles)
    assert copy == model and hash(copy) == hash(model)
    assert copy.profile("1g.12gb") is model.profile("1g.12gb")
    other = GpuModel(model.name, model.product, model.memory_slots, model.memory_mib + 1, model.profiles)
    assert hash(other) != hash(model)


def test_get_model_refuses_what_is_not_a_name() -> None:
    known = ", ".join(sorted(CATALOG))
    with pytest.raises(CatalogError) as info:
        get_model(["h200-141gb"])  # unhashable
    assert str(info.value) == f"unknown GPU model ['h200-141gb']; known: {known}"


@pytest.mark.parametrize(("product", "mib", "expected"), [
    # Within 5 % of the catalog's total (integer 5 %: 143771 // 20 = 7188 MiB), either way.
    ("NVIDIA H200", 143771 - 7188, "h200-141gb"),
    ("NVIDIA H200", 143771 + 7188, "h200-141gb"),
    ("NVIDIA H200", 143771 - 7189, None),
    ("NVIDIA H200", 143771 + 7189, None),
    # Words are compared lower-cased and split on anything not a letter or digit.
    ("nvidia h200", 143771, "h200-141gb"),
    ("NVIDIA_H200", 143771, "h200-141gb"),
    ("NVIDIAH200", 143771, None),
])
def test_model_for_product_edges(product: str, mib: int, expected: str | None) -> None:
    found = model_for_product(product, mib)
    assert (found.name if found else None) == expected
