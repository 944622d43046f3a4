"""Stand-in: Megatron's async-save queue (empty here: stock async saving is not used in the tests)."""


def maybe_finalize_async_save(blocking: bool = False, terminate: bool = False):
    return None
