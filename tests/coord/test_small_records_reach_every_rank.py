"""The ranks' exchange of small records (plan messages, votes): every rank's object, whole and
in rank order, over a real gloo group, in gathers whose parts stay below ATen's parallel grain
(see `safe_ckpt.coord.dist._all_gather_objects` for the cost that rule removes). The part sizes are
checked as a rule here; what the rule saves is measured by benchmarks/plan_exchange.py on a
host with more cores than ranks, which a test on this 2-core machine cannot show."""

import random

from tests.helpers.mp import run_world, values

GRAIN_ELEMENTS = 32768  # ATen's parallel grain: a copy of fewer elements stays on its thread


def _payload(rank: int) -> dict:
    """Rank-specific objects of very different sizes: one byte, a plan-sized message, 600 KB."""
    size = (1, 81_102, 600_000)[rank]
    return {"rank": rank, "bytes": random.Random(rank).randbytes(size), "shards": [(rank, i) for i in range(rank * 50)]}


def _exchange_twice(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from safe_ckpt import compat
    from safe_ckpt.coord import dist as safe_dist

    gathered_elements = []
    real = compat.all_gather_into_tensor

    def recording(output, input_tensor, group):
        gathered_elements.append(input_tensor.numel())
        real(output, input_tensor, group)

    compat.all_gather_into_tensor = recording
    group = dist.new_group(backend="gloo")  # as safe_ckpt's cached group: not the default one
    coord = safe_dist.Coordinator(group, rank, world, "exchange test")
    first = coord.exchange("records", _payload(rank))
    safe_dist.GATHER_WORDS = 1000  # the same objects in many smaller gathers
    second = coord.exchange("records again", _payload(rank))
    return {"first": first, "second": second, "gathered_elements": gathered_elements}


def test_every_rank_gets_every_ranks_object_whole_and_in_rank_order():
    results = values(run_world(3, _exchange_twice, timeout_s=180))
    expected = [_payload(r) for r in range(3)]
    for rank, got in enumerate(results):
        assert got["first"] == expected, f"rank {rank}: the exchange changed or reordered the objects"
        assert got["second"] == expected, f"rank {rank}: the objects came back wrong from many small gathers"
        parts = got["gathered_elements"]
        # sizes, then the longest message (600,000 bytes and its envelope) in parts of at most
        # 32767 words: 3, on the first exchange; on the second, in parts of 1000 words: 76.
        assert parts[0] == 1 and parts[1:3] == [32767, 32767] and 9375 < parts[3] < 10_000, \
            f"rank {rank}: the first exchange gathered {parts[:4]}"
        assert parts[4] == 1 and parts[5:-1] == [1000] * 75 and 0 < parts[-1] <= 1000 and len(parts) == 81, \
            f"rank {rank}: the second exchange gathered {parts[4:]}"
        assert max(parts) < GRAIN_ELEMENTS, f"rank {rank}: a gather of {max(parts)} elements starts ATen's parallel copy"
