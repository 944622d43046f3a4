"""A real `PosixSink` whose item writes first call a hook: a writer on a busy core, or one held
at a gate, without faking any of the writing itself."""

from safe_ckpt.sinks.posix import PosixSink


class HookedSink(PosixSink):
    """Subclasses override `before_write`, called in the writer's thread before each item write."""

    def __init__(self, root):
        super().__init__(root, fsync=False)

    def before_write(self) -> None:
        pass

    def open(self, relative_path, size_bytes):
        inner = super().open(relative_path, size_bytes)
        sink = self

        class File:
            def write_at(self, offset_bytes, buffers):
                sink.before_write()
                inner.write_at(offset_bytes, buffers)

            def sync(self):
                inner.sync()

            def close(self):
                inner.close()

        return File()
