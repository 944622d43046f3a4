"""A new object at the address of one that was freed, for tests of caches that must not
confuse a dead object with a new one (CPython hands a freed address out again, sooner or later)."""

import gc


def new_at_freed_address(address: int, make, tries: int = 10_000):
    """``make()`` until one result sits at ``address`` (the caller has dropped the object that
    was there); that object, or None where the interpreter did not reuse the address."""
    gc.collect()
    kept = []  # held until the search ends, so each try gets a fresh address
    for _ in range(tries):
        candidate = make()
        if id(candidate) == address:
            return candidate
        kept.append(candidate)
    return None
