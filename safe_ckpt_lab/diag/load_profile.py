"""Where one `safe_ckpt.load` spends its Python time: cProfile on the calling thread and on each
reader thread (merged), written as text.

One job: profile a load the caller runs inside `profiled(path)`. The reader threads are profiled
by wrapping `execute.Reader._loop`, so the split works on Python 3.11 (whose profiler sees one
thread) and 3.12 alike. Profiling slows Python-heavy parts more than system calls: read the
shares between functions, not the totals. Must not: time anything that is reported as a timing.
"""

from __future__ import annotations

import contextlib
import cProfile
import io
import pstats
import threading


@contextlib.contextmanager
def profiled(path: str, top: int = 40):
    from safe_ckpt.loading import execute

    readers: list = []
    lock = threading.Lock()
    stock = execute.Reader._loop

    def loop(self):
        prof = cProfile.Profile()
        with lock:
            readers.append(prof)
        prof.enable()
        try:
            stock(self)
        finally:
            prof.disable()

    main = cProfile.Profile()
    execute.Reader._loop = loop
    main.enable()
    try:
        yield
    finally:
        main.disable()
        execute.Reader._loop = stock
        out = io.StringIO()
        out.write("== the calling thread, by cumulative time\n")
        pstats.Stats(main, stream=out).sort_stats("cumulative").print_stats(top)
        if readers:
            merged = pstats.Stats(readers[0], stream=out)
            for prof in readers[1:]:
                merged.add(prof)
            out.write(f"== the {len(readers)} reader threads, merged, by own time\n")
            merged.sort_stats("tottime").print_stats(top)
        with open(path, "w") as f:
            f.write(out.getvalue())
