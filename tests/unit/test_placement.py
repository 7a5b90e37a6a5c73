"""Multi-device engine settings: the placement-group shape, and the spec checks that tie an
engine's parallel sizes to resources.devices_per_actor (each error names its fields)."""

from __future__ import annotations

from typing import Any

import pytest

from pipeline.batch.driver.placement import bundles, strategy
from pipeline.spec import ResourcesSpec, SpecError, parse_job_spec
from tests.unit.test_spec import with_changes


def spec_with(engine: dict[str, Any], **resources: Any):
    return parse_job_spec(with_changes(engine=engine, resources=resources))


def test_bundles_hold_one_gpu_each_and_the_actor_cpus_in_the_first():
    res = ResourcesSpec(
        devices_per_actor=4, cpus_per_actor=2, actor_resources={"h200": 1}, placement="spread"
    )
    assert bundles(res) == [
        {"GPU": 1.0, "CPU": 2.0, "h200": 1},
        {"GPU": 1.0},
        {"GPU": 1.0},
        {"GPU": 1.0},
    ]
    assert strategy(res) == "SPREAD"
    assert res.multi_device
    assert strategy(ResourcesSpec()) == "PACK"  # the default: one node when it has the GPUs
    assert not ResourcesSpec(devices_per_actor=1).multi_device


@pytest.mark.parametrize(
    ("resources", "message"),
    [
        ({"devices_per_actor": 2.5}, r"resources.devices_per_actor 2.5: above 1 it must be"),
        ({"placement": "cluster"}, r"resources.placement"),
        ({"placement_timeout_s": 0}, r"resources.placement_timeout_s"),
    ],
)
def test_bad_resources_name_the_field(resources: dict[str, Any], message: str):
    with pytest.raises(SpecError, match=message):
        spec_with({"kind": "reference"}, **resources)


def test_parallel_sizes_must_multiply_to_devices_per_actor():
    ok = spec_with(
        {"kind": "trtllm", "extra": {"tensor_parallel_size": 4, "pipeline_parallel_size": 2}},
        devices_per_actor=8,
    )
    assert ok.resources.devices_per_actor == 8
    spec_with(
        {"kind": "vllm", "extra": {"tensor_parallel_size": 2, "data_parallel_size": 2}},
        devices_per_actor=4,
        placement="strict_pack",
    )
    with pytest.raises(SpecError) as caught:
        spec_with({"kind": "trtllm", "extra": {"tensor_parallel_size": 2}}, devices_per_actor=4)
    text = str(caught.value)
    assert "tensor_parallel_size 2" in text and "resources.devices_per_actor (4)" in text
    # More GPUs in the engine than reserved: the engine would wait for GPUs never given.
    with pytest.raises(SpecError, match=r"= 2 device\(s\).*devices_per_actor \(1\)"):
        spec_with({"kind": "vllm", "extra": {"pipeline_parallel_size": 2}}, devices_per_actor=1)


def test_one_device_engines_are_unchanged():
    assert spec_with({"kind": "trtllm"}, devices_per_actor=1).resources.devices_per_actor == 1
    assert spec_with({"kind": "vllm"}).resources.devices_per_actor == 0  # CPU vLLM


def test_trtllm_moe_sizes_split_the_tensor_parallel_ranks():
    extra = {
        "tensor_parallel_size": 8,
        "moe_expert_parallel_size": 4,
        "moe_tensor_parallel_size": 2,
        "enable_attention_dp": True,
    }
    spec_with({"kind": "trtllm", "extra": extra}, devices_per_actor=8)
    bad = {**extra, "moe_expert_parallel_size": 8}
    with pytest.raises(SpecError, match=r"moe_tensor_parallel_size 2 x .*= 16.*tensor_parallel"):
        spec_with({"kind": "trtllm", "extra": bad}, devices_per_actor=8)
    with pytest.raises(SpecError, match=r"engine.extra.pipeline_parallel_size must be a whole"):
        spec_with({"kind": "trtllm", "extra": {"pipeline_parallel_size": 0}}, devices_per_actor=2)
