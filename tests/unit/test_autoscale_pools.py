"""core/autoscale/pools.py: the pools file, every field checked with the value named and a valid pool
shown, and the pod that stands for one new node. Expected values are worked out by hand here."""

from __future__ import annotations

import json
from fractions import Fraction

import pytest
import yaml

from mig_operator.core.autoscale.pools import (
    MAX_GPUS_PER_NODE,
    MAX_NODES_LIMIT,
    MAX_POOLS,
    MIG_LABEL,
    POOL_EXAMPLE,
    PoolError,
    chunk_pod_spec,
    read_pools,
)
from mig_operator.core.placement.profiles import CATALOG

GI = 2**30


def pool(**fields: object) -> dict:
    """A valid pool, with ``fields`` replacing (or, set to ``...``, leaving out) its own."""
    base: dict = {"name": "h200", "nodeLabels": {"pool": "h200", MIG_LABEL: "mig"}, "gpuModel": "h200-141gb",
                  "gpusPerNode": 8, "cpu": "190", "memory": "1900Gi"}
    base.update(fields)
    return {k: v for k, v in base.items() if v is not ...}


def refused(data: object) -> str:
    with pytest.raises(PoolError) as raised:
        read_pools(data)
    return str(raised.value)


def test_a_valid_pool_reads_every_field() -> None:
    taint = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}
    (read,) = read_pools([pool(taints=[taint, {"key": "dedicated", "effect": "NoExecute"}], maxNodes=4)])
    assert read.name == "h200" and dict(read.labels) == {"pool": "h200", MIG_LABEL: "mig"}
    assert read.model is CATALOG["h200-141gb"] and read.gpus == 8 and read.max_nodes == 4
    assert read.cpu == 190 and read.memory == 1900 * GI
    assert read.taints == (taint, {"key": "dedicated", "effect": "NoExecute"})
    assert read.mig


def test_defaults_one_gpu_ten_nodes_no_taints() -> None:
    (read,) = read_pools([pool(gpusPerNode=..., maxNodes=..., cpu="15500m", memory="62.5Gi")])
    assert read.gpus == 1 and read.max_nodes == 10 and read.taints == ()
    assert read.cpu == Fraction(31, 2) and read.memory == 62 * GI + GI // 2


def test_the_pools_key_and_the_bare_list_read_the_same() -> None:
    assert read_pools({"pools": [pool()]}) == read_pools([pool()])


def test_yaml_and_json_forms_read_the_same() -> None:
    as_yaml = """
- name: l40s
  nodeLabels: {node.kubernetes.io/instance-type: g6e.12xlarge}
  gpuModel: l40s-48gb
  gpusPerNode: 4
  cpu: "48"
  memory: 384Gi
  taints:
  - {key: nvidia.com/gpu, effect: NoSchedule}
"""
    as_json = json.dumps([{"name": "l40s", "nodeLabels": {"node.kubernetes.io/instance-type": "g6e.12xlarge"},
                           "gpuModel": "l40s-48gb", "gpusPerNode": 4, "cpu": "48", "memory": "384Gi",
                           "taints": [{"key": "nvidia.com/gpu", "effect": "NoSchedule"}]}])
    from_yaml, from_json = read_pools(yaml.safe_load(as_yaml)), read_pools(yaml.safe_load(as_json))
    assert from_yaml == from_json
    assert from_yaml[0].gpus == 4 and from_yaml[0].memory == 384 * GI and not from_yaml[0].mig


def test_a_cpu_given_as_a_whole_number_is_taken() -> None:
    assert read_pools([pool(cpu=190)])[0].cpu == 190


@pytest.mark.parametrize(("fields", "named"), [
    ({"name": "H200"}, "'H200'"),
    ({"name": "h200_a"}, "'h200_a'"),
    ({"name": "-h200"}, "'-h200'"),
    ({"name": "a" * 41}, "at most 40 characters"),
    ({"name": ...}, "name None"),
    ({"name": 200}, "name 200"),
    ({"nodeLabels": {}}, "nodeLabels is empty"),
    ({"nodeLabels": ...}, "nodeLabels None"),
    ({"nodeLabels": ["pool=h200"]}, "['pool=h200']"),
    ({"nodeLabels": {"pool": "a b"}}, "'a b'"),
    ({"nodeLabels": {"bad key!": "x"}}, "'bad key!'"),
    ({"nodeLabels": {"pool": 1}}, "'pool': 1"),
    ({"nodeLabels": {f"k{i}": "v" for i in range(33)}}, "at most 32 labels"),
    ({"gpuModel": "h300"}, "'h300'"),
    ({"gpuModel": ...}, "None"),
    ({"gpuModel": ["h200-141gb"]}, "['h200-141gb']"),
    ({"gpusPerNode": 0}, "gpusPerNode 0"),
    ({"gpusPerNode": MAX_GPUS_PER_NODE + 1}, f"gpusPerNode {MAX_GPUS_PER_NODE + 1}"),
    ({"gpusPerNode": "8"}, "gpusPerNode '8'"),
    ({"gpusPerNode": 8.0}, "gpusPerNode 8.0"),
    ({"gpusPerNode": True}, "gpusPerNode True"),
    ({"gpusPerNode": "\u0668"}, "'\u0668'"),  # ARABIC-INDIC DIGIT EIGHT
    ({"maxNodes": 0}, "maxNodes 0"),
    ({"maxNodes": MAX_NODES_LIMIT + 1}, f"maxNodes {MAX_NODES_LIMIT + 1}"),
    ({"maxNodes": False}, "maxNodes False"),
    ({"maxNodes": -3}, "maxNodes -3"),
    ({"cpu": "0"}, "cpu '0'"),
    ({"cpu": "-2"}, "cpu '-2'"),
    ({"cpu": "lots"}, "cpu 'lots'"),
    ({"cpu": "\uff11\uff19\uff10"}, "'\uff11\uff19\uff10'"),  # FULLWIDTH 190
    ({"cpu": "\u0661\u0669\u0660"}, "'\u0661\u0669\u0660'"),  # ARABIC-INDIC 190
    ({"cpu": 1.5}, "cpu 1.5"),
    ({"cpu": True}, "cpu True"),
    ({"cpu": ...}, "cpu None"),
    ({"memory": "1900GiB"}, "'1900GiB'"),
    ({"memory": "\u0967\u0669\u0966\u0966Gi"}, "'\u0967\u0669\u0966\u0966Gi'"),  # DEVANAGARI 1900
    ({"memory": "0Gi"}, "memory '0Gi'"),
    ({"memory": "500m"}, "memory '500m'"),  # half a byte
    ({"memory": ...}, "memory None"),
    ({"taints": {"key": "a", "effect": "NoSchedule"}}, "taints {'key': 'a'"),
    ({"taints": [{"key": "a", "effect": "Sometimes"}]}, "'Sometimes'"),
    ({"taints": [{"key": "a"}]}, "{'key': 'a'}"),
    ({"taints": [{"key": "a", "effect": "NoSchedule", "operator": "Exists"}]}, "'operator': 'Exists'"),
    ({"taints": ["a=b:NoSchedule"]}, "'a=b:NoSchedule'"),
    ({"taints": [{"key": "a b", "effect": "NoSchedule"}]}, "'a b'"),
    ({"taints": None}, "taints None"),
])
def test_a_bad_value_is_named_and_a_valid_pool_is_shown(fields: dict, named: str) -> None:
    message = refused([pool(**fields)])
    assert message.startswith("autoscaling pool 0: ") and named in message, message
    assert POOL_EXAMPLE in message
    assert len(message) < 1200


def test_the_example_in_the_message_is_itself_a_valid_pool() -> None:
    (example,) = read_pools([json.loads(POOL_EXAMPLE)])
    assert example.gpus == 8 and example.mig


def test_the_index_of_the_bad_pool_is_named() -> None:
    message = refused([pool(name="a"), pool(name="b"), pool(name="c", gpusPerNode=99)])
    assert message.startswith("autoscaling pool 2: ") and "gpusPerNode 99" in message


def test_unknown_fields_are_named_with_the_known_ones() -> None:
    message = refused([pool(gpus=8, maxnodes=3)])
    assert "unknown field(s) 'gpus, maxnodes'" in message
    assert "known: cpu, gpuModel, gpusPerNode, maxNodes, memory, name, nodeLabels, taints" in message


def test_a_non_text_field_name_is_named_too() -> None:
    assert "unknown field(s) '7'" in refused([{**pool(), 7: "x"}])


def test_duplicate_names_are_refused_naming_them() -> None:
    message = refused([pool(name="a"), pool(name="b"), pool(name="a"), pool(name="b"), pool(name="c")])
    assert "autoscaling pool name(s) a, b used twice" in message


@pytest.mark.parametrize("data", [[], {}, "h200", None, {"pools": [], "extra": 1}, [pool()] * (MAX_POOLS + 1)])
def test_the_file_must_be_a_list_of_1_to_32_pools(data: object) -> None:
    message = refused(data)
    assert f"is not a list of 1 to {MAX_POOLS} pools" in message and POOL_EXAMPLE in message


def test_32_distinct_pools_are_taken() -> None:
    assert len(read_pools([pool(name=f"p{i}") for i in range(MAX_POOLS)])) == MAX_POOLS


@pytest.mark.parametrize("entry", ["h200", 7, None, ["name", "h200"]])
def test_a_pool_that_is_not_a_map_is_named(entry: object) -> None:
    message = refused([entry])
    assert f"autoscaling pool 0: {entry!r} is not a map" in message


def test_huge_values_are_clipped_in_the_message() -> None:
    for fields in ({"name": "x" * 100_000}, {"cpu": "9" * 100_000}, {"gpusPerNode": 10**5000},
                   {"nodeLabels": {"pool": "v" * 100_000}}, {"gpuModel": "m" * 100_000}):
        message = refused([pool(**fields)])
        assert len(message) < 1500, (list(fields), len(message))


def test_a_mig_labelled_pool_of_a_gpu_without_mig_is_not_a_mig_pool() -> None:
    (l40s,) = read_pools([pool(gpuModel="l40s-48gb")])
    assert l40s.labels[MIG_LABEL] == "mig" and not l40s.mig
    (unlabelled,) = read_pools([pool(nodeLabels={"pool": "h200"})])
    assert not unlabelled.mig
    (other,) = read_pools([pool(nodeLabels={"pool": "h200", MIG_LABEL: "fraction"})])
    assert not other.mig


def test_the_chunk_pod_asks_for_just_over_half_the_node() -> None:
    taint = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}
    (read,) = read_pools([pool(cpu="15", memory="61Gi", taints=[taint])])
    spec = chunk_pod_spec(read, "example.com/pause:1")
    # Half of 15 cores is 7500m, so 7501m; half of 61Gi is 31232Mi, so 31233Mi: two never fit one node.
    (container,) = spec["containers"]
    assert container["resources"] == {"requests": {"cpu": "7501m", "memory": "31233Mi"}}
    assert container["image"] == "example.com/pause:1"
    assert 2 * 7501 > 15_000 and 2 * 31233 * 2**20 > 61 * GI
    assert spec["nodeSelector"] == {"pool": "h200", MIG_LABEL: "mig"}
    assert spec["tolerations"] == [{"operator": "Equal", **taint}]
    assert "nvidia.com/gpu" not in json.dumps(container["resources"])  # no resource the new node lacks


def test_the_chunk_pod_of_an_untainted_pool_has_no_tolerations() -> None:
    (read,) = read_pools([pool(cpu="1", memory="1Mi")])
    spec = chunk_pod_spec(read, "pause")
    # 1 core: 500m + 1; 1Mi: 0Mi + 1.
    assert spec["containers"][0]["resources"]["requests"] == {"cpu": "501m", "memory": "1Mi"}
    assert "tolerations" not in spec
