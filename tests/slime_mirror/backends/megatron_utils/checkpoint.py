from megatron.training.checkpointing import save_checkpoint  # as slime: a plain re-export

__all__ = ["save_checkpoint"]
