"""Publication of a checkpoint on a key-value store, where there is no rename.

One job: make a checkpoint written under a kvstore prefix visible only once every rank's
data is durable, with the small files as the commit marker. Data files carry the save's
id in their names, so a new save never overwrites the files of a previous checkpoint at
the same prefix. Commit order (rank 0): remove `metadata.json` (Megatron's "this is a
checkpoint" marker) if a previous checkpoint is there, then the common state, the
manifest and `.metadata`, then `metadata.json` last; finally the data files no longer
referenced. An interrupted save leaves no `metadata.json`, which no loader takes for a
checkpoint. Re-saving the same prefix is therefore not atomic on a kvstore (the old
checkpoint is gone once the commit starts): prefer a new prefix per iteration.

Must not: rely on rename or directories.
"""

from __future__ import annotations

from .errors import CommitError

METADATA_FILE = ".metadata"
CONFIG_FILE = "metadata.json"


def check_target(sink, replace: str) -> None:
    keys = sink.list()
    if not keys or replace == "any":
        return
    complete = METADATA_FILE in keys and CONFIG_FILE in keys
    if replace == "never":
        raise CommitError(f"{sink.root} is not empty and SaveOptions(replace='never') forbids replacing it")
    if not complete:
        raise CommitError(
            f"{sink.root} holds keys but no complete torch_dist checkpoint (foreign data or a broken save); "
            "refusing to replace it. Remove them, or pass SaveOptions(replace='any')"
        )


def publish(sink, small_files: dict[str, bytes], data_files: set[str]) -> None:
    """Write the small files (``.metadata`` and ``metadata.json`` in ``small_files``) in commit order."""
    existing = set(sink.list())
    if CONFIG_FILE in existing:
        sink.delete(CONFIG_FILE)
    for name, data in small_files.items():
        if name not in (METADATA_FILE, CONFIG_FILE):
            sink.write_file(name, data)
    sink.write_file(METADATA_FILE, small_files[METADATA_FILE])
    sink.write_file(CONFIG_FILE, small_files[CONFIG_FILE])
    for name in existing:
        if name.endswith(".distcp") and name not in data_files:
            try:
                sink.delete(name)
            except Exception:  # a leftover data file is harmless: nothing references it
                pass


def abort(sink, tag: str) -> None:
    """Remove the data files this save wrote (best effort)."""
    try:
        for name in sink.list():
            if name.endswith(f"{tag}.distcp"):
                sink.delete(name)
    except Exception:
        pass


def new_file_tag(save_id: str) -> str:
    if not save_id:
        raise CommitError("internal error: no save id for kvstore file names")
    return f"-{save_id}"
