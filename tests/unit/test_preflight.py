"""Multi-node preflight (mingpt/runtime/preflight.py): the comparison as a table (no process group) and the code
fingerprint. The checks on real agents are scenarios/test_preflight_nodes.py."""

import dataclasses

import pytest

from mingpt.runtime.preflight import Report, code_fingerprint, compare


def node(n: int, **changes) -> Report:
    base = Report(host=f"host{n}", node=n, local_rank=0, local_world_size=1, code={"mingpt/model/gpt.py": "aaa"},
                  versions={"python": "3.11.7", "torch": "2.13.0", "nccl": "-"}, config="c1",
                  data="100 bytes, abc", sees_probe=True)
    return dataclasses.replace(base, **changes)


@pytest.mark.parametrize("other, expected", [
    ({}, None),
    ({"code": {"mingpt/model/gpt.py": "bbb"}}, "mingpt's code differs between nodes: host1 (node 1) runs other files than "
                                           "rank 0 on host0 (node 0) (mingpt/model/gpt.py); install the same version"),
    ({"versions": {"python": "3.11.7", "torch": "2.12.0", "nccl": "-"}},
     "torch versions differ between nodes (2.13.0 on host0 (node 0); 2.12.0 on host1 (node 1))"),
    ({"config": "c2"}, "the resolved config differs between nodes: host1 (node 1) was started with other settings"),
    ({"data": "missing"}, "data.path=corpus.txt is missing on host1 (node 1) but present on the other nodes"),
    ({"data": "99 bytes, abd"}, "data.path=corpus.txt differs between nodes (100 bytes, abc on host0 (node 0); "
                                "99 bytes, abd on host1 (node 1))"),
    ({"sees_probe": False}, "snapshot.dir=runs/x/snapshots is not shared between nodes: host1 (node 1) cannot see "
                            "what rank 0 on host0 (node 0) writes there"),
    ({"device": "cuda", "gpus": ["H100"] * 4, "local_world_size": 8},
     "host1 (node 1) has 4 GPUs for 8 processes; lower --nproc_per_node to 4 there"),
], ids=["same", "code", "torch", "config", "corpus-missing", "corpus-differs", "store", "gpus"])
def test_each_difference_is_one_line_naming_the_node(other, expected):
    problems, _ = compare([node(0), node(1, **other)], data_path="corpus.txt", store_url="runs/x/snapshots")
    if expected is None:
        assert problems == []
    else:
        assert len(problems) == 1 and problems[0].startswith(expected), problems
        assert "\n" not in problems[0]


def test_mixed_gpu_models_are_a_warning_not_a_failure():
    problems, warnings = compare([node(0, device="cuda", gpus=["NVIDIA H100"]),
                                  node(1, device="cuda", gpus=["NVIDIA A100"])])
    assert problems == [] and "different GPU models (NVIDIA A100, NVIDIA H100)" in warnings[0]


def test_the_code_fingerprint_covers_sources_and_configs():
    fp = code_fingerprint()
    assert "mingpt/model/gpt.py" in fp and "mingpt/runtime/preflight.py" in fp and "conf/config.yaml" in fp
