"""How byte counts read in messages and logs (every stage's messages use it).

One job: format a count of bytes for a person. Must not: import anything of safe_ckpt.
"""


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


def counted(n: int, noun: str) -> str:
    """``n`` and the noun, plural where ``n`` is not 1 ("1 item", "3 items")."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"
