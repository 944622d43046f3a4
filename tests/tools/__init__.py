"""The command line and the read-only tools: verify, inspect, gc, copy; never running code from
a checkpoint; messages as a user reads them."""
