"""The parallel strategy seam (mingpt/parallel/layouts.py) in one process: the HSDP mesh."""

import pytest


def test_the_hsdp_mesh_is_nodes_by_processes_and_odd_worlds_are_refused_in_one_line():
    from mingpt.parallel.layouts import ParallelError, mesh_shape

    two_by_two = [(0, 0, 0), (0, 1, 1), (1, 0, 2), (1, 1, 3)]  # (torchrun node, local rank, rank) by rank
    assert mesh_shape(two_by_two, one_node_ok=False) == (2, 2)
    assert mesh_shape([(5, 0, 0), (5, 1, 1), (5, 2, 2), (2, 0, 3), (2, 1, 4), (2, 2, 5)], False) == (2, 3)
    with pytest.raises(ParallelError, match="these nodes hold 2, 1: give every node the same --nproc_per_node"):
        mesh_shape([(0, 0, 0), (0, 1, 1), (1, 0, 2)], one_node_ok=False)
    one_node = [(0, 0, 0), (0, 1, 1)]
    with pytest.raises(ParallelError, match=r"hsdp on one node \(2 processes\) is FSDP: use trainer.parallel=fsdp"):
        mesh_shape(one_node, one_node_ok=False)
    assert mesh_shape(one_node, one_node_ok=True) == (1, 2)  # a run that lost its other nodes carries on
    with pytest.raises(ParallelError, match="ranks to be consecutive"):
        mesh_shape([(0, 0, 0), (1, 0, 1), (0, 1, 2), (1, 1, 3)], one_node_ok=False)


def test_each_pipeline_stage_gets_its_own_data_dimensions_and_hsdp_whole_nodes():
    """Stage-major ranks: a stage's processes are consecutive, so HSDP inside a stage replicates over
    the stage's nodes and shards within each; a stage that is one node, or nodes that do not split
    into the stages, are refused in one line."""
    from mingpt.parallel.layouts import ParallelError, data_shape

    def nodes(n: int, per: int) -> list[tuple[int, int, int]]:
        return [(r // per, r % per, r) for r in range(n * per)]

    assert data_shape(nodes(4, 2), "hsdp", 1, 2, one_node_ok=False) == (2, 2)  # 2 nodes of 2 in each of 2 stages
    assert data_shape(nodes(4, 2), "hsdp", 2, 2, one_node_ok=False) == (2, 1)  # tensor parallel within each node
    assert data_shape(nodes(4, 2), "ddp", 2, 2, one_node_ok=False) == (2, 1)
    assert data_shape(nodes(4, 2), "fsdp", 1, 2, one_node_ok=False) == (1, 4)
    assert data_shape(nodes(2, 2), "hsdp", 1, 1, one_node_ok=False) == (2, 2)  # no pipeline: as before
    with pytest.raises(ParallelError, match="puts each stage on one node, which is FSDP: use trainer.parallel=fsdp"):
        data_shape(nodes(2, 2), "hsdp", 1, 2, one_node_ok=False)
    assert data_shape(nodes(2, 2), "hsdp", 1, 2, one_node_ok=True) == (1, 2)  # an HSDP run that lost nodes goes on
    with pytest.raises(ParallelError, match="these 3 node.s. of 2 processes do not split into 2: start a multiple of 2"):
        data_shape(nodes(3, 2), "hsdp", 1, 2, one_node_ok=False)
