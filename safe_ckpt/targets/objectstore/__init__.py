"""A checkpoint under an object-store prefix (a TensorStore kvstore: S3, GCS, `file://`):
publication with `metadata.json` as the commit marker and the owner object of a running save
(`publish`), the leftovers `safe-ckpt gc` removes (`gc`), and a save root's tracker and
retention (`root`).
"""
