"""A warning at start for shared KV tiers that run without --kv-secret.

Without a secret a record is still checked for damage (xxh3) and identity (model
fingerprint, key, layout), but anyone who can write to the tier can plant a well-formed
record with a valid checksum, and the engine serves its KV as if it had computed it
(docs/RELIABILITY.md, "What --kv-secret protects"). On a private tier that is expected;
a shared one should not run that way by accident. Shared means: a Redis tier with a node
that is not on loopback, or a disk directory that another running process also uses, or
that other users may write to.

Processes find each other through the disk directory itself: each holds a shared `flock`
on it for its lifetime, and one that cannot take it exclusively for a moment is not alone.
"""

from __future__ import annotations

import fcntl
import ipaddress
import logging
import os
import stat
from pathlib import Path

from engine.config import EngineConfig
from kvstore.config import redis_nodes

logger = logging.getLogger(__name__)

_held: dict[str, int] = {}  # disk directory (real path) -> fd of our shared lock on it


def shared_tiers_without_secret(config: EngineConfig) -> list[str]:
    """Why others can write records this engine would trust (empty with --kv-secret)."""
    if config.kv_secret:
        return []
    reasons = []
    if "redis" in config.kv_offload:
        nodes = redis_nodes(config.kv_redis_url)
        remote = [f"{host}:{port}" for host, port in nodes if not is_loopback(host)]
        if remote:
            reasons.append(f"the redis tier's {', '.join(remote)} is not on loopback")
    if "disk" in config.kv_offload:
        reasons += _shared_directory(Path(config.disk_path))
    return reasons


def warn_if_shared_without_secret(config: EngineConfig) -> None:
    for reason in shared_tiers_without_secret(config):
        logger.warning(
            "%s, and --kv-secret is not set: whoever can write there can plant KV records that "
            "this engine serves as its own. Set --kv-secret-file on every instance (docs/RELIABILITY.md).",
            reason,
        )


def is_loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve anywhere
        return False


def _shared_directory(directory: Path) -> list[str]:
    reasons = []
    if _other_process_uses(directory):
        reasons.append(f"the disk directory {directory} is used by another running process")
    try:
        info = directory.stat()
    except OSError:
        return reasons
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        reasons.append(f"the disk directory {directory} is writable by other users")
    elif info.st_uid != os.geteuid():
        reasons.append(f"the disk directory {directory} belongs to another user")
    return reasons


def _other_process_uses(directory: Path) -> bool:
    """Register this process as a user of `directory` (a shared lock it keeps) and say
    whether another process holds one too."""
    key = os.path.realpath(directory)
    fd = _held.get(key)
    if fd is None:
        try:
            fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
        except OSError:
            return False
        _held[key] = fd
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        others = False
    except BlockingIOError:
        others = True
    fcntl.flock(fd, fcntl.LOCK_SH)
    return others
