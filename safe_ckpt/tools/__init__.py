"""Read-only and housekeeping tools behind the CLI: `verify`, `inspect`, `gc`, `copy`; `safe_load` reads a
checkpoint's pickled files without running code from them, `locate` resolves the path a user gave."""
