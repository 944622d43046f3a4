"""The bytes of the format, both ways: each chunk's torch.save container (`torchzip`), where
each item sits in which file (`layout`), the DCP index (`metadata`), the small files a commit
writes (`small_files`: `.metadata`, `metadata.json`, the manifest, `integrity.json` through
`integrity_manifest`), and the restricted reader of a checkpoint's pickled files (`safe_read`).
Must not: touch devices, talk to other ranks, or write files.
"""
