"""Device bytes to host memory the writers read: a reused pinned pool (`pool`), the copies on
side streams and the device checksums beside them (`stager`), host views without copies
(`views`), and the hand-off of staged items to free writers (`dispatch`).
Must not: write files or know about the checkpoint's layout.
"""
