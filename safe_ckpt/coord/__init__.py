"""Coordination: every rank of a save in step over a CPU (gloo) group.

`dist` (the group, exchanges of small records with bounded waits, and the one voting
collective), `ballot` (a stage's failures noted on each rank and decided together), `slot`
(one save of a target at a time in this process). Must not: know about plans, tensors or
files (`plan.agreement` turns exchanged plan messages into the global plan).
"""
