"""Ranks in step: exchanges, votes, failures on one rank failing all, saves that never pair."""
