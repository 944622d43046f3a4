"""Do Megatron's data-parallel collectives run over gloo on CUDA tensors when several ranks share
one GPU? The real-model resume test at DP > 1 on a one-GPU machine needs them to.

Runs N processes (every rank on cuda:0, a gloo default group) and calls, on CUDA tensors of
seeded random data, each collective the distributed optimizer and DDP use:
`reduce_scatter_tensor`, `all_gather_into_tensor`, `all_reduce`, `broadcast`, `all_gather`.
Each call's result is checked against the same reduction done on the host. Prints one line per
call: ok, wrong, or the exact exception, and writes them as JSON to --out.

    python benchmarks/probe_dp_gloo.py --ranks 2 --out probe.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _probe(rank: int, world: int) -> dict:
    import torch
    import torch.distributed as dist

    dev = torch.device("cuda", 0)
    out = {}
    numel = 1 << 16

    def inputs(r):
        g = torch.Generator().manual_seed(1000 + r)
        return torch.randn(world * numel, generator=g)

    everyone = [inputs(r) for r in range(world)]
    total = torch.stack(everyone).sum(0)

    def attempt(name, fn):
        try:
            ok = fn()
            out[name] = "ok" if ok else "wrong result"
        except Exception as exc:  # the exact failure is the probe's answer
            out[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"

    def reduce_scatter():
        dst = torch.empty(numel, device=dev)
        dist.reduce_scatter_tensor(dst, everyone[rank].to(dev))
        # a sum of more than two addends depends on their order: compare within rounding
        return torch.allclose(dst.cpu(), total[rank * numel:(rank + 1) * numel], rtol=0, atol=1e-5)

    def all_gather_into():
        mine = everyone[rank][:numel].to(dev)
        dst = torch.empty(world * numel, device=dev)
        dist.all_gather_into_tensor(dst, mine)
        return torch.equal(dst.cpu(), torch.cat([e[:numel] for e in everyone]))

    def all_reduce():
        t = everyone[rank].to(dev)
        dist.all_reduce(t)
        return torch.allclose(t.cpu(), total, rtol=0, atol=1e-5)

    def broadcast():
        t = everyone[rank].to(dev)
        dist.broadcast(t, src=0)
        return torch.equal(t.cpu(), everyone[0])

    def all_gather():
        mine = everyone[rank][:numel].to(dev)
        outs = [torch.empty(numel, device=dev) for _ in range(world)]
        dist.all_gather(outs, mine)
        return all(torch.equal(o.cpu(), e[:numel]) for o, e in zip(outs, everyone))

    for name, fn in [("reduce_scatter_tensor", reduce_scatter), ("all_gather_into_tensor", all_gather_into),
                     ("all_reduce", all_reduce), ("broadcast", broadcast), ("all_gather", all_gather)]:
        attempt(name, fn)
        dist.barrier()
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    from tests.helpers.mp import run_world

    report = {}
    for n in args.ranks:
        results = run_world(n, _probe, timeout_s=120)
        report[str(n)] = [{"status": s, "value": v if s == "ok" else (v.get("message") if isinstance(v, dict) else v)}
                          for s, v in results]
        for r, (s, v) in enumerate(results):
            print(f"ranks={n} rank={r} {s}: {v if s == 'ok' else v.get('message', v) if isinstance(v, dict) else v}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
