"""This process's share of its host during a save: writer and hashing threads, the staging
pool's size, the writers' priority (`cpu`), and the garbage collector held off the training
process's heap (`gcfreeze`). Must not: know about plans or files.
"""
