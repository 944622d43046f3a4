"""Stand-in: the global args of megatron.training.global_vars."""

_GLOBAL_ARGS = None


def get_args():
    assert _GLOBAL_ARGS is not None, "args is not initialized."
    return _GLOBAL_ARGS


def set_args(args):
    global _GLOBAL_ARGS
    _GLOBAL_ARGS = args
