"""Diagnostic helpers the scripts of `benchmarks/diag/` measure with: experiments the library
tried and does not ship (early writeback, a staging pool on huge pages), kept runnable here."""
