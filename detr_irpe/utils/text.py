"""Small wording helpers for the messages the tools show."""

from __future__ import annotations


def plural(count: int, word: str, words: str | None = None) -> str:
    """``1 epoch``, ``2 epochs`` (``words``: an irregular plural)."""
    return f"{count} {word if count == 1 else (words or word + 's')}"


__all__ = ["plural"]
