"""From sharded state dicts to one plan every rank agrees on: chunking, validation, refusals
that name paths and ranks, hostile input."""
