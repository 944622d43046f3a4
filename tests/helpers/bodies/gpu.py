"""Bodies of the GPU tests (run in spawned ranks, see mp.py); imported only where CUDA exists."""

from __future__ import annotations

import os

import torch

import safe_ckpt
from safe_ckpt_lab.bench.measure import RssPeak, host_alloc_bytes
from safe_ckpt_lab.synthetic import StateSpec, build_state, reference_tensors
from tests.helpers.bodies.common import SMALL, compare_loaded, small_options
from tests.helpers.mp import describe_exception

GPU_SPEC = dict(SMALL, hidden=128, ffn=512, vocab=1024, bucket_numel=300_000)


def _optimizer_pieces(state):
    for pieces in state["optimizer"]["distributed"].values():
        for piece in pieces:
            yield piece["tensor"]


def place(state: dict, residence: str) -> dict:
    """Move the optimizer shards: 'cuda' (all on the GPU), 'pinned', 'pageable', or 'mixed'
    (param and exp_avg pinned, exp_avg_sq pageable; weights stay on the GPU)."""
    for sh in _optimizer_pieces(state):
        kind = residence
        if residence == "mixed":
            kind = "pageable" if sh.key.endswith("exp_avg_sq") else "pinned"
        if kind == "pinned":
            sh.data = sh.data.cpu().pin_memory()
        elif kind == "pageable":
            sh.data = sh.data.cpu()
    return state


def gpu_roundtrip(rank, world, ckpt_dir, residence, use_async) -> dict:
    from megatron.core import dist_checkpointing

    torch.cuda.set_device(0)
    spec = StateSpec(**GPU_SPEC)
    refs = reference_tensors(spec, world)
    state = place(build_state(rank, world, tp=world, spec=spec, device="cuda", references=refs), residence)
    opts = small_options(chunk_bytes=256 * 1024, staging_budget_bytes=4 << 20)
    if use_async:
        handle = safe_ckpt.async_save(state, ckpt_dir, options=opts)
        stall = handle.stall_s
        result = handle.wait(timeout=300)
    else:
        result = safe_ckpt.save(state, ckpt_dir, options=opts)
        stall = result.timings.stall_s
    target = build_state(rank, world, tp=world, spec=spec, layout="alt", empty=True, references=refs,
                         saved_tp=world)
    expected = build_state(rank, world, tp=world, spec=spec, layout="alt", references=refs, saved_tp=world)
    loaded = dist_checkpointing.load(target, ckpt_dir)
    return {"mismatches": compare_loaded(loaded, expected), "residences": result.bytes_by_residence,
            "stall_s": stall}


def count_h2d(rank, world, ckpt_dir) -> dict:
    """Memcpy events seen by the CUDA profiler during save and async_save of a mixed state."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.set_device(0)
    spec = StateSpec(**GPU_SPEC)
    refs = reference_tensors(spec, world)
    counts = {}
    for mode in ("sync", "async"):
        state = place(build_state(rank, world, tp=world, spec=spec, device="cuda", references=refs), "mixed")
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            path = f"{ckpt_dir}_{mode}"
            if mode == "sync":
                safe_ckpt.save(state, path, options=small_options())
            else:
                safe_ckpt.async_save(state, path, options=small_options()).wait(timeout=300)
            torch.cuda.synchronize()
        counts[mode] = _memcpy_counts(prof)
    # The error path: a refused save (overlapping GPU shards) must not touch the device either.
    from megatron.core.dist_checkpointing import ShardedTensor

    data = torch.randn(4, 4, device="cuda")
    bad = {f"x{i}": ShardedTensor("x", data, data.dtype, (4, 4), (6, 4), (2 * i, 0), axis_fragmentations=None)
           for i in range(2)}
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        try:
            safe_ckpt.save(bad, f"{ckpt_dir}_refused", options=small_options())
            counts["refused_error"] = None
        except safe_ckpt.ValidationError as exc:
            counts["refused_error"] = str(exc)
        torch.cuda.synchronize()
    counts["refused"] = _memcpy_counts(prof)
    return counts


def _memcpy_counts(prof) -> dict:
    names = [e.name or "" for e in prof.events()]
    return {
        "HtoD": sum("HtoD" in n for n in names),
        "DtoH": sum("DtoH" in n for n in names),
        "nccl": sum("nccl" in n.lower() for n in names),
    }


def nccl_default_group(rank, world, ckpt_dir) -> dict:
    """The default process group is NCCL: safe_ckpt must coordinate over its own gloo group."""
    from megatron.core import dist_checkpointing
    from torch.profiler import ProfilerActivity, profile

    spec = StateSpec(**GPU_SPEC)
    refs = reference_tensors(spec, world)
    state = place(build_state(rank, world, tp=world, spec=spec, device="cuda", references=refs), "mixed")
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        safe_ckpt.save(state, ckpt_dir, options=small_options())
        torch.cuda.synchronize()
    target = build_state(rank, world, tp=world, spec=spec, layout="alt", empty=True, references=refs, saved_tp=world)
    expected = build_state(rank, world, tp=world, spec=spec, layout="alt", references=refs, saved_tp=world)
    loaded = dist_checkpointing.load(target, ckpt_dir)
    return {"backend": torch.distributed.get_backend(), "counts": _memcpy_counts(prof),
            "mismatches": compare_loaded(loaded, expected)}


class VmmTensor:
    """Device memory mapped with the CUDA VMM API, wrapped as a torch tensor, unmappable on demand."""

    def __init__(self, numel: int, dtype=torch.float32):
        from cuda.bindings import driver as cu

        self.cu = cu
        dev = torch.cuda.current_device()
        prop = cu.CUmemAllocationProp()
        prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = dev
        gran = self._ok(cu.cuMemGetAllocationGranularity(
            prop, cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM))
        nbytes = numel * dtype.itemsize
        self.size = -(-nbytes // gran) * gran
        self.ptr = self._ok(cu.cuMemAddressReserve(self.size, 0, 0, 0))
        self.handle = self._ok(cu.cuMemCreate(self.size, prop, 0))
        self._ok(cu.cuMemMap(self.ptr, self.size, 0, self.handle, 0))
        access = cu.CUmemAccessDesc()
        access.location = prop.location
        access.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        self._ok(cu.cuMemSetAccess(self.ptr, self.size, [access], 1))
        typestr = {torch.float32: "<f4", torch.float16: "<f2", torch.int64: "<i8"}[dtype]
        iface = {"shape": (numel,), "typestr": typestr, "data": (int(self.ptr), False), "version": 3}
        holder = type("Holder", (), {"__cuda_array_interface__": iface})()
        self.tensor = torch.as_tensor(holder, device="cuda")

    def _ok(self, ret):
        err, *rest = ret if isinstance(ret, tuple) else (ret,)
        if int(err) != 0:
            raise RuntimeError(f"CUDA driver call failed: {err}")
        return rest[0] if rest else None

    def unmap(self):
        torch.cuda.synchronize()
        self._ok(self.cu.cuMemUnmap(self.ptr, self.size))
        self._ok(self.cu.cuMemRelease(self.handle))


def unmapped_is_refused(rank, world, root) -> dict:
    """Rank world-1 holds a tensor whose VMM memory is unmapped; every rank must raise ResidenceError."""
    from megatron.core.dist_checkpointing import ShardedTensor

    from safe_ckpt.residence import classify as residence

    torch.cuda.set_device(0)
    g = torch.Generator(device="cuda").manual_seed(rank)
    vmm = VmmTensor(1 << 20)
    vmm.tensor.copy_(torch.randn(1 << 20, device="cuda", generator=g))
    before = residence.classify(vmm.tensor).residence
    if rank == world - 1:
        vmm.unmap()
    after = residence.classify(vmm.tensor).residence
    good = torch.randn(64, 64, device="cuda", generator=g)
    state = {
        "good": ShardedTensor.from_rank_offsets("good", good, (0, rank, world)),
        "paused": ShardedTensor.from_rank_offsets("paused", vmm.tensor, (0, rank, world)),
    }
    out = {"before": before, "after": after}
    for policy in ("error", "cpu_backup"):
        target = os.path.join(root, f"ckpt_{policy}")
        try:
            safe_ckpt.save(state, target, options=small_options(unmapped_policy=policy))
            out[policy] = None
        except BaseException as exc:
            out[policy] = describe_exception(exc)
        torch.distributed.barrier()
        out[f"{policy}_committed"] = os.path.exists(target)
    # The process is still healthy: the device works and a later save succeeds.
    out["device_ok"] = int(torch.arange(10, device="cuda").sum().item()) == 45
    torch.cuda.synchronize()
    del state["paused"]
    safe_ckpt.save(state, os.path.join(root, "after"), options=small_options())
    out["later_save_ok"] = os.path.exists(os.path.join(root, "after", ".metadata"))
    return out


def memory_saver_pause(rank, world, root) -> dict:
    """Real torch_memory_saver (torch hook mode, CPU backup): refuse, read the backup, resume, save."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor
    from torch_memory_saver import torch_memory_saver as tms

    from safe_ckpt_lab.synthetic import bits_equal

    torch.cuda.set_device(0)
    tms.hook_mode = "torch"
    g = torch.Generator(device="cuda").manual_seed(7 + rank)
    with tms.region(tag="train", enable_cpu_backup=True):
        weight = torch.randn(256, 1024, device="cuda", generator=g).to(torch.bfloat16)
        state_t = torch.randn(1 << 20, device="cuda", generator=g)
    half = weight[:, 512:]  # a strided view at a storage offset: backed up as the range it spans
    reference = {"w": weight.cpu(), "s": state_t.cpu(), "h": half.cpu()}

    def sharded():
        return {"w": ShardedTensor.from_rank_offsets("w", weight, (0, rank, world)),
                "s": ShardedTensor.from_rank_offsets("s", state_t, (0, rank, world)),
                "h": ShardedTensor.from_rank_offsets("h", half, (0, rank, world))}

    def load(path):
        target = {"w": ShardedTensor.from_rank_offsets("w", torch.empty(256, 1024, dtype=torch.bfloat16),
                                                       (0, rank, world)),
                  "s": ShardedTensor.from_rank_offsets("s", torch.empty(1 << 20), (0, rank, world)),
                  "h": ShardedTensor.from_rank_offsets("h", torch.empty(256, 512, dtype=torch.bfloat16),
                                                       (0, rank, world))}
        got = dist_checkpointing.load(target, path)
        return all(bits_equal(got[k], reference[k]) for k in reference)

    torch.cuda.synchronize()
    tms.pause("train")
    out = {}
    try:
        safe_ckpt.save(sharded(), os.path.join(root, "refused"), options=small_options())
        out["paused_error"] = None
    except BaseException as exc:
        out["paused_error"] = describe_exception(exc)
    torch.distributed.barrier()
    res = safe_ckpt.save(sharded(), os.path.join(root, "from_backup"),
                         options=small_options(unmapped_policy="cpu_backup"))
    out["backup_residences"] = res.bytes_by_residence
    out["backup_bit_exact"] = load(os.path.join(root, "from_backup"))
    tms.resume("train")
    res = safe_ckpt.save(sharded(), os.path.join(root, "resumed"), options=small_options())
    out["resumed_residences"] = res.bytes_by_residence
    out["resumed_bit_exact"] = load(os.path.join(root, "resumed"))
    return out


def pool_reuse(rank, world, root) -> dict:
    """Two saves of ~1 GiB GPU state with a 256 MiB budget; the pinned pool is allocated only once."""
    from megatron.core.dist_checkpointing import ShardedTensor

    torch.cuda.set_device(0)
    g = torch.Generator(device="cuda").manual_seed(3)
    budget = 256 << 20
    state = {f"w{i}": ShardedTensor.from_rank_offsets(f"w{i}", torch.randn(32 << 20, device="cuda", generator=g))
             for i in range(8)}  # 8 x 128 MiB
    opts = small_options(chunk_bytes=32 << 20, staging_budget_bytes=budget, io_threads=4)
    out = {"budget": budget, "saves": []}
    for i in range(2):
        torch.cuda.empty_cache()
        torch._C._host_emptyCache()  # what a colocated offload cycle does between saves
        host_before = host_alloc_bytes()
        with RssPeak(period_s=0.001) as rss:
            res = safe_ckpt.save(state, os.path.join(root, f"s{i}"), options=opts)
        out["saves"].append({
            "pool_allocations": res.staging_pool_allocations,
            "torch_host_allocs": None if host_before is None else host_alloc_bytes() - host_before,
            "extra_rss": rss.extra_bytes,
            "device_bytes": res.bytes_by_residence.get("cuda", 0),
        })
    return out


MODES_DEVICE_CHECKSUMS = ("sync", "async", "off", "sync_early", "sync_torch_copies")


def device_checksums(rank, world, ckpt_dir) -> dict:
    """Saves of a GPU state with large chunks, some 4-byte aligned and some not, with device
    checksums on (sync, async) and off: memcpy counts, the manifest's algorithms, verify from the
    files on the host (which recomputes the sums with numpy), stock load, and a corrupted copy."""
    import collections
    import shutil

    from megatron.core import dist_checkpointing
    from torch.profiler import ProfilerActivity, profile

    from safe_ckpt.integrity import Manifest
    from safe_ckpt.names import MANIFEST_FILE
    from safe_ckpt.tools.verify import verify

    torch.cuda.set_device(0)
    # Odd rows (1031 bf16) put every other row cut at 2 mod 4 bytes; chunks reach 12 MiB, past the
    # device-sum threshold.
    spec = StateSpec(**dict(GPU_SPEC, hidden=1031, ffn=4124, vocab=8200, bucket_numel=3_000_001))
    refs = reference_tensors(spec, world)
    from safe_ckpt import cuda_driver
    from safe_ckpt.write import pipeline

    out = {}
    # sync / async: writers held until every copy is issued, so the sums are deferred (and flushed
    # when the 128 MiB pool runs out); sync_early: writers from the start, sums enqueued with each
    # copy; sync_torch_copies: copies through Tensor.copy_ instead of the CUDA driver.
    for mode in MODES_DEVICE_CHECKSUMS:
        state = build_state(rank, world, tp=world, spec=spec, device="cuda", references=refs)
        opts = small_options(chunk_bytes=12 << 20, staging_budget_bytes=128 << 20, device_checksums=mode != "off")
        path = f"{ckpt_dir}_{mode}"
        saved = pipeline.EARLY_WRITERS_MIN_CHUNK_BYTES, cuda_driver.copies_available
        if mode == "sync_early":
            pipeline.EARLY_WRITERS_MIN_CHUNK_BYTES = 1
        if mode == "sync_torch_copies":
            cuda_driver.copies_available = lambda: False
        torch.cuda.synchronize()
        try:
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                if mode == "async":
                    safe_ckpt.async_save(state, path, options=opts).wait(timeout=300)
                else:
                    safe_ckpt.save(state, path, options=opts)
                torch.cuda.synchronize()
        finally:
            pipeline.EARLY_WRITERS_MIN_CHUNK_BYTES, cuda_driver.copies_available = saved
        manifest = Manifest.parse(open(os.path.join(path, MANIFEST_FILE), "rb").read())
        report = verify(path, deep=True)
        target = build_state(rank, world, tp=world, spec=spec, layout="alt", empty=True, references=refs,
                             saved_tp=world)
        expected = build_state(rank, world, tp=world, spec=spec, layout="alt", references=refs, saved_tp=world)
        out[mode] = {
            "counts": _memcpy_counts(prof),
            "algorithms": dict(collections.Counter(i.algorithm or manifest.algorithm for i in manifest.items)),
            "verify_ok": report.ok, "findings": [f.message for f in report.findings][:5],
            "checksummed": report.checksummed_items, "items": report.items_checked,
            "mismatches": compare_loaded(dist_checkpointing.load(target, path), expected),
        }
        if mode == "sync":
            item = next(i for i in manifest.items if i.algorithm.startswith("grid32+"))
            bad = f"{ckpt_dir}_corrupt"
            shutil.copytree(path, bad)
            with open(os.path.join(bad, item.relative_path), "r+b") as f:
                at = item.offset_bytes + item.payload_offset_bytes + item.payload_length_bytes // 2
                f.seek(at)
                byte = f.read(1)
                f.seek(at)
                f.write(bytes([byte[0] ^ 1]))
            out["corrupt_findings"] = [(f.path, f.message) for f in verify(bad).findings if f.severity == "error"]
            out["corrupt_item"] = f"{item.relative_path}@{item.offset_bytes}"
    return out


def bench_device_copy(rank, world, root) -> dict:
    """The bench's combined ceiling's device-to-host copy: every CUDA tensor's bytes, back to
    back, bit-exact; run from another thread (as the bench runs it) right after the sources
    change behind 0.2 s of GPU work, it must wait for that work; and that ceiling beside writes."""
    import threading

    from safe_ckpt_lab.bench import ceilings

    g = torch.Generator(device="cuda").manual_seed(21)
    sources = [torch.randn(1000, 37, device="cuda", generator=g).to(torch.bfloat16),
               torch.randn(4097, device="cuda", generator=g),
               torch.randint(0, 1 << 30, (513,), device="cuda", generator=g, dtype=torch.int64)]
    host = torch.randn(64)
    copy = ceilings.device_to_host_copier([sources[0], host, "not a tensor", *sources[1:]])

    def expected() -> bytes:
        return b"".join(t.cpu().reshape(-1).view(torch.uint8).numpy().tobytes() for t in sources)

    try:
        first = copy.buffer.numpy().tobytes() == expected()
        torch.cuda._sleep(400_000_000)  # cycles: 0.2 s or more at up to 2 GHz
        for t in sources:
            t.add_(1)  # queued behind the sleep: a copy that does not wait for it reads the old bytes
        side = threading.Thread(target=copy)
        side.start()
        side.join()
        second = copy.buffer.numpy().tobytes() == expected()
        best = ceilings.write_beside_copy(os.path.join(root, "w"), 64 << 20, 4, copy, reps=2)
        return {"first": first, "second": second, "tensors": len(copy.tensors),
                "write_s": best.write_s, "copy_s": best.copy_s}
    finally:
        copy.close()
