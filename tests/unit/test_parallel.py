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
