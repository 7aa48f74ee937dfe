"""Exceptions raised by tiers.

Tier I/O failures never escape a tier's async methods: they are counted, update the
tier's health and turn into misses. What is raised is configuration that cannot work.
"""

from __future__ import annotations


class TierError(Exception):
    """Base class of tier errors."""


class TierConfigError(TierError, ValueError):
    """A tier was configured with values that cannot work (size, path, URL)."""


class RedisUrlError(TierConfigError):
    """A Redis URL is malformed or uses an unsupported scheme."""
