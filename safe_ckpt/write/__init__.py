"""One rank's write phase: staged items wrapped in their containers, written to the sink,
checksummed and synced by a pool of writer threads (`pipeline`, `item_writes`), with progress
lines (`progress`). Must not: decide the layout, talk to other ranks, or publish.
"""
