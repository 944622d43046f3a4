"""Reading a checkpoint back: `safe_ckpt.load` against stock load, damaged checkpoints, object
stores, Megatron's load_checkpoint."""
