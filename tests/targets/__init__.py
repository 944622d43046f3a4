"""A checkpoint's destination: publication into a directory under interruption, the last good
checkpoint surviving, object stores (a real S3 API) beside hostile neighbours."""
