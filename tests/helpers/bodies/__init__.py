"""Rank bodies: functions each rank of a gloo world runs (see `tests.helpers.mp`), imported by
module name in spawned processes; they return plain data for the test to assert on."""
