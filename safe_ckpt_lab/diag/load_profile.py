"""Where one `safe_ckpt.load` spends its Python time: cProfile on the calling thread and on each
reader thread (merged), written as text.

One job: profile a load the caller runs inside `profiled(path)`. On Python 3.11 (whose profiler
sees one thread) the reader threads are profiled apart, by wrapping `execute.Reader._loop`; from
3.12 one profiler sees every thread and a second one cannot be enabled, so the report is one merged
table. Profiling slows Python-heavy parts more than system calls: read the shares between
functions, not the totals. Must not: time anything that is reported as a timing.
"""

from __future__ import annotations

import contextlib
import cProfile
import io
import pstats
import sys
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
    per_thread = sys.version_info < (3, 12)
    if per_thread:
        execute.Reader._loop = loop
    main.enable()
    try:
        yield
    finally:
        main.disable()
        execute.Reader._loop = stock
        out = io.StringIO()
        out.write("== the calling thread, by cumulative time\n" if per_thread else
                  "== every thread (Python 3.12+: one profiler sees them all), by cumulative time\n")
        pstats.Stats(main, stream=out).sort_stats("cumulative").print_stats(top)
        if readers:
            merged = pstats.Stats(readers[0], stream=out)
            for prof in readers[1:]:
                merged.add(prof)
            out.write(f"== the {len(readers)} reader threads, merged, by own time\n")
            merged.sort_stats("tottime").print_stats(top)
        with open(path, "w") as f:
            f.write(out.getvalue())
