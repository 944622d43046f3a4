"""The checkpoint's `.metadata`: the DCP index every stock loader starts from.

One job: build the pickled `torch.distributed.checkpoint.metadata.Metadata` (tensor
and bytes entries, chunk lists, and each item's file/offset/length) from the global
plan and the layouts of all ranks. Must not: read tensor data or write files.
"""

from __future__ import annotations

import pickle

from .. import compat
from ..plan.records import GlobalPlan
from .layout import RankLayout


def build_metadata(plan: GlobalPlan, layouts: list[RankLayout], checkpoint_id: str, save_id: str):
    chunks: dict[str, list] = {t.fqn: [] for t in plan.tensors}
    storage_data = {}
    bytes_fqns = []
    for layout in layouts:
        for item in layout.items:
            info = compat.storage_info(item.relative_path, item.offset_bytes, item.length_bytes)
            if item.chunk is not None:
                box = item.chunk.global_box
                chunks[item.fqn].append(box)
                storage_data[compat.metadata_index(item.fqn, box.offsets)] = info
            else:
                bytes_fqns.append(item.fqn)
                storage_data[compat.metadata_index(item.fqn)] = info
    state_dict_metadata = {}
    for t in plan.tensors:
        boxes = sorted(chunks[t.fqn], key=lambda b: b.offsets)
        state_dict_metadata[t.fqn] = compat.tensor_storage_metadata(
            t.dtype, t.global_shape, [compat.chunk_metadata(b.offsets, b.sizes) for b in boxes]
        )
    for fqn in sorted(bytes_fqns):
        state_dict_metadata[fqn] = compat.bytes_storage_metadata()
    return compat.dcp_metadata(state_dict_metadata, storage_data, checkpoint_id, save_id)


def metadata_bytes(metadata) -> bytes:
    return pickle.dumps(metadata)
