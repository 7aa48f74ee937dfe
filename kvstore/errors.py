"""Exceptions of the KV store.

`RecordError` and its subclasses describe a record that must not be used; the store
catches them, counts them on the tier the record came from (`counter` names the tier
counter) and treats the chunk as a miss. They never reach the engine.
"""

from __future__ import annotations


class StoreError(Exception):
    """Base class of store errors."""


class StoreConfigError(StoreError, ValueError):
    """Store options that cannot work; `option` names the StoreConfig field when one is
    to blame (its name is also the option's keyword and, with dashes, its flag)."""

    def __init__(self, message: str, option: str | None = None) -> None:
        super().__init__(message)
        self.option = option


class StoreClosedError(StoreError, RuntimeError):
    """The store was closed; it accepts no more work."""


class ChunkSpecError(StoreError, ValueError):
    """A tensor handed to the store does not match its ChunkSpec (a caller bug)."""


class RecordError(StoreError):
    counter = "rejected_records"


class TruncatedRecordError(RecordError):
    counter = "checksum_failures"


class BadMagicError(RecordError):
    counter = "checksum_failures"


class ChecksumMismatchError(RecordError):
    counter = "checksum_failures"


class AuthenticationError(RecordError):
    """HMAC missing (the store has a secret) or not matching."""

    counter = "auth_failures"


class UnsupportedVersionError(RecordError):
    pass


class RecordFormatError(RecordError):
    """Inconsistent header fields (flags, lengths, shape rank)."""


class FingerprintMismatchError(RecordError):
    """A record of another model or layout."""


class KeyMismatchError(RecordError):
    """A valid record stored under the wrong key."""


class LayoutMismatchError(RecordError):
    """The record's dtype, shape or size differs from the store's ChunkSpec."""


class CompressionError(RecordError):
    """The payload did not decompress to exactly the expected size."""
