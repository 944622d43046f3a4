"""Stand-in for Megatron-LM's megatron.training (see tests/stand_ins/README.md)."""

from .global_vars import get_args, set_args

__all__ = ["get_args", "set_args"]
