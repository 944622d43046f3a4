"""Loading torch_dist checkpoints: `load` with the contract of megatron-core's
`dist_checkpointing.load`, reading in parallel and safely.

Data flow (one module per step):
  source / kvsource  the checkpoint's files: a directory (regular files inside it only,
                     positioned reads) or a TensorStore kvstore prefix (ranged reads)
  index              `metadata.json`, `.metadata` (restricted unpickler), checksum manifest
  objects            common state and ShardedObjects (torch's weights-only unpickler)
  plan               each rank's read plan: the stored chunks overlapping each requested
                     shard, byte ranges, batches of small items (boxes: the arithmetic)
  execute            a bounded thread pool: positioned reads straight into host tensors,
                     through the pinned pool and side streams into GPU tensors, checksums
                     and archive framing (container) checked on the way
  sharded            plan, vote, read, vote: what a load strategy's `load` returns
  contract           stock `load`'s steps around it (factories, common state, strictness)
"""

from .contract import load
from .report import ReadReport
from .options import LoadOptions

__all__ = ["LoadOptions", "ReadReport", "load"]
