"""On-disk names of a torch_dist checkpoint and of safe_ckpt's own files, keys and directories.

One job: every file, key and directory name the format or the publication protocol uses, and
the few functions that build or parse them; every other module takes them from here (tests
keep their own literals on purpose: they pin the format independently of this module).
Must not: import anything but the standard library.
"""

from __future__ import annotations

import re

# --- a torch_dist checkpoint (Megatron's and DCP's names) ------------------------------------
METADATA_FILE = ".metadata"  # DCP's index: every stock loader starts from it
CONFIG_FILE = "metadata.json"  # Megatron's CheckpointingConfig; an object store's commit marker
COMMON_STATE_FILE = "common.pt"  # megatron-core <= 0.18: the common state, rank 0's torch.save
COMMON_STATE_KEY = "common_state"  # megatron-core 0.19: the common state as a ShardedObject
INTEGRITY_FILE = "integrity.json"  # megatron.core.dist_checkpointing.validation.INTEGRITY_FNAME
SHARDED_BACKEND = "torch_dist"  # metadata.json's sharded_backend, and the strategy's registry key
SHARDED_BACKEND_VERSION = 1

# --- a Megatron save root ------------------------------------------------------------------
TRACKER_FILE = "latest_checkpointed_iteration.txt"
RELEASE_DIR = "release"  # the tracker's word, and the directory it names
ITERATION_DIR = re.compile(r"^iter_(\d{7,})$")
CHECKPOINT_DIR = re.compile(r"^(iter_\d{7,}|release)$")


def iteration_dir(iteration: int) -> str:
    """The directory Megatron gives iteration ``iteration``'s checkpoint: `iter_0000042`."""
    return f"iter_{iteration:07d}"


def iteration_of(name: str) -> int | None:
    """The iteration of an `iter_NNNNNNN` name; None for any other name."""
    m = ITERATION_DIR.match(name)
    return int(m.group(1)) if m else None


# --- data files ----------------------------------------------------------------------------
DATA_SUFFIX = ".distcp"
DATA_FILE = re.compile(r"^__(\d+)_(\d+)(?:-[0-9a-f]+)?\.distcp$")  # __RANK_INDEX[-SAVEID].distcp
TAGGED_DATA_FILE = re.compile(r"^__\d+_\d+-([0-9a-f]{8,})\.distcp$")  # one save's file in an object store


def data_file(rank: int, index: int, tag: str = "") -> str:
    """A data file's name: `__RANK_INDEX.distcp`, or with ``tag`` (`file_tag`) `__RANK_INDEX-SAVEID.distcp`."""
    return f"__{rank}_{index}{tag}{DATA_SUFFIX}"


def is_data_file(name: str) -> bool:
    """A DCP data file's name, whoever wrote it (`__` ... `.distcp`)."""
    return name.startswith("__") and name.endswith(DATA_SUFFIX)


def file_tag(save_id: str) -> str:
    """What one save's data file names carry in an object store: `-SAVEID`."""
    return f"-{save_id}"


def has_file_tag(name: str, tag: str) -> bool:
    """Whether ``name`` is a data file carrying ``tag`` (`file_tag`)."""
    return name.endswith(f"{tag}{DATA_SUFFIX}")


# --- safe_ckpt's own files -----------------------------------------------------------------
MANIFEST_FILE = "safe_ckpt_manifest.json"  # per-item checksums; stock loaders ignore it
MANIFEST_FORMAT = "safe_ckpt-manifest"
# What a save writes besides its data files (the manifest and the common state are optional).
SMALL_FILES = (METADATA_FILE, CONFIG_FILE, COMMON_STATE_FILE, MANIFEST_FILE)
SAVE_ID_CHARS = 16  # hex digits of a save id

HIDDEN = ".safe_ckpt-"  # every hidden name safe_ckpt makes carries this
STAGING_MARK = HIDDEN + "staging-"  # a save's staging directory beside its target
REPLACED_MARK = HIDDEN + "replaced-"  # the checkpoint a save replaced, until the new one is durable
DELETING_MARK = HIDDEN + "deleting-"  # a checkpoint being removed (retention, a replace)
LEFTOVER_MARKS = (STAGING_MARK, REPLACED_MARK, DELETING_MARK)
OWNER_FILE = HIDDEN + "owner"  # the owner record inside a staging directory
OWNER_OBJECT_PREFIX = OWNER_FILE + "-"  # an object store's owner object: this + the save id
OWNER_OBJECT = re.compile("^" + re.escape(OWNER_OBJECT_PREFIX) + r"([0-9a-f]{8,})$")


def owner_object(save_id: str) -> str:
    """The key of a running save's owner object in an object store."""
    return OWNER_OBJECT_PREFIX + save_id


def save_id_of(name: str) -> str | None:
    """The save id in an object store's data file or owner object name; None for any other name."""
    m = OWNER_OBJECT.match(name) or TAGGED_DATA_FILE.match(name)
    return m.group(1) if m else None
