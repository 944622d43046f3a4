"""The bytes of the format: containers stock torch reads, layouts stock loaders read, Megatron's
integrity manifest, and the restricted reader of untrusted `.metadata` files."""
