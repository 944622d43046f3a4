"""Where the benchmark puts a host's ranks: one per GPU where there are enough, else sharing
the GPUs over a gloo-only group (NCCL refuses two ranks on one device)."""

from safe_ckpt_lab.bench.run import Placement, placement


def test_one_rank_per_gpu_where_there_are_enough():
    assert placement(3, 8, 8) == Placement(3, "cpu:gloo,cuda:nccl", 1)
    assert placement(0, 1, 1) == Placement(0, "cpu:gloo,cuda:nccl", 1)


def test_more_ranks_than_gpus_share_them_over_gloo():
    assert [placement(r, 8, 1) for r in (0, 5, 7)] == [Placement(0, "gloo", 8)] * 3
    assert [placement(r, 4, 2).device for r in range(4)] == [0, 1, 0, 1]
    assert placement(2, 3, 2) == Placement(0, "gloo", 2)


def test_no_gpu_is_gloo_on_the_host():
    assert placement(1, 4, 0) == Placement(None, "gloo", 0)
