"""Read-only and housekeeping tools behind the CLI: `verify`, `inspect`, `gc`."""
