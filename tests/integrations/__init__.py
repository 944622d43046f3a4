"""The edges: the Megatron adapters and megatron-core floor, slime through real Ray actors and
its asleep save."""
