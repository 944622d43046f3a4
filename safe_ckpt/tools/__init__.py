"""Read-only and housekeeping tools behind the CLI: `verify`, `inspect`, `gc`, `copy`; `safe_load` reads a
checkpoint's pickled files without running code from them (`.metadata` through `metadata_unpickler`, within
a work budget), `checkpoint_files` opens a checkpoint's files (regular files inside it only), `locate`
resolves the path a user gave."""
