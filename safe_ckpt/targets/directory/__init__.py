"""A checkpoint directory on a filesystem: the save's claim (`claim`), its hidden staging and
leftover siblings (`leftovers`), publication by rename (`publish`) or into a directory Megatron's
own save fills (`inplace`), the tracker a save root points with (`locate` follows it), and
`safe-ckpt gc` over a save root (`gc`).
"""
