"""Where kvtier keeps what it builds for a user: $XDG_CACHE_HOME/kvtier (or ~/.cache/kvtier)."""

from __future__ import annotations

import os


def kvtier_cache_dir(*parts: str) -> str:
    """`$XDG_CACHE_HOME/kvtier/<parts>`, with ~/.cache when XDG_CACHE_HOME is unset."""
    cache_home = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache_home, "kvtier", *parts)
