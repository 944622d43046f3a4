"""Test helpers, never collected: worlds of gloo ranks (`mp`), a local S3 server (`s3server`), one
real sink with hooks around its writes (`hooked_sinks`), repository paths (`paths`), and the rank
bodies `mp.run_world` runs (`bodies/`)."""
