"""One save end to end in one process: odd shapes, async source checks, host-share defaults, the
index built while the writers write, log records."""
