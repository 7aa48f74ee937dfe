"""Parse the Redis URLs the store accepts.

- `redis://[[user]:password@]host[:port][/db]`
- `rediss://...` (TLS)
- `redis+cluster://[[user]:password@]host:port,host:port,...` (Redis Cluster seed nodes;
  `rediss+cluster://` for TLS). A cluster has only database 0.
- `unix://[[user]:password@]/path/to/redis.sock[?db=N]` (a Redis on this host, through
  its Unix socket: no TCP stack between the two processes).

Not redis-py's `parse_url`: it reads redis://, rediss:// and unix:// with passwords, but
has no form for a list of cluster seed nodes, and it accepts what a store must refuse
at start rather than misread: a URL without a host, a database that is not a number
(dropped silently), query parameters (taken as connection options), a relative socket
path.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from urllib.parse import unquote

from tiers.errors import RedisUrlError

DEFAULT_PORT = 6379
_SCHEMES = {
    "redis": (False, False),
    "rediss": (False, True),
    "redis+cluster": (True, False),
    "rediss+cluster": (True, True),
}


@dataclass(frozen=True)
class RedisTarget:
    cluster: bool
    ssl: bool
    nodes: tuple[tuple[str, int], ...]
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    db: int = 0
    socket_path: str | None = None  # a Unix socket instead of `nodes`

    def describe(self) -> str:
        """The URL without credentials (safe to log)."""
        if self.socket_path is not None:
            return f"unix://{self.socket_path}?db={self.db}"
        scheme = ("rediss" if self.ssl else "redis") + ("+cluster" if self.cluster else "")
        hosts = ",".join(f"{h}:{p}" for h, p in self.nodes)
        return f"{scheme}://{hosts}/{self.db}"


def parse_redis_url(url: str) -> RedisTarget:
    scheme, sep, rest = url.partition("://")
    if sep and scheme.lower() == "unix":
        return _unix_target(rest, url)
    if not sep or scheme.lower() not in _SCHEMES:
        raise RedisUrlError(
            f"unsupported Redis URL {_redact(url)!r}; use "
            f"{', '.join(s + '://' for s in (*_SCHEMES, 'unix'))}"
        )
    cluster, ssl = _SCHEMES[scheme.lower()]
    if "?" in rest or "#" in rest:
        raise RedisUrlError(f"Redis URL parameters are not supported: {_redact(url)!r}")
    netloc, _, path = rest.partition("/")
    userinfo, at, hostlist = netloc.rpartition("@")
    username, password = _credentials(userinfo) if at else (None, None)
    nodes = tuple(_host_port(part, url) for part in hostlist.split(","))
    if not cluster and len(nodes) != 1:
        raise RedisUrlError(f"several hosts need redis+cluster://, got {_redact(url)!r}")
    db = _database(path, url)
    if cluster and db:
        raise RedisUrlError("a Redis Cluster only has database 0")
    return RedisTarget(cluster, ssl, nodes, username, password, db)


def _unix_target(rest: str, url: str) -> RedisTarget:
    location, _, query = rest.partition("?")
    userinfo, at, path = ("", "", location) if location.startswith("/") else location.partition("@")
    username, password = _credentials(userinfo) if at else (None, None)
    if not path.startswith("/") or path == "/":
        raise RedisUrlError(f"a unix:// Redis URL needs the socket's absolute path: {_redact(url)!r}")
    name, equals, value = query.partition("=")
    if query and (name != "db" or not equals):
        raise RedisUrlError(f"a unix:// Redis URL takes only ?db=N: {_redact(url)!r}")
    db = _database(value, url) if query else 0
    return RedisTarget(False, False, (), username, password, db, socket_path=unquote(path))


def _credentials(userinfo: str) -> tuple[str | None, str | None]:
    user, colon, password = userinfo.partition(":")
    if not colon:
        return None, unquote(user) or None
    return unquote(user) or None, unquote(password) or None


def _host_port(text: str, url: str) -> tuple[str, int]:
    text = text.strip()
    if text.startswith("["):
        host, _, tail = text[1:].partition("]")
        port_text = tail.removeprefix(":")
    else:
        host, _, port_text = text.partition(":")
    if not host:
        raise RedisUrlError(f"Redis URL without a host: {_redact(url)!r}")
    try:
        port = int(port_text) if port_text else DEFAULT_PORT
    except ValueError:
        raise RedisUrlError(f"bad port {port_text!r} in Redis URL {_redact(url)!r}") from None
    if not 0 < port < 65536:
        raise RedisUrlError(f"port {port} out of range in Redis URL {_redact(url)!r}")
    return host, port


def _database(path: str, url: str) -> int:
    if not path:
        return 0
    if not path.isdigit():
        raise RedisUrlError(f"bad database {path!r} in Redis URL {_redact(url)!r}")
    return int(path)


def _redact(url: str) -> str:
    scheme, sep, rest = url.partition("://")
    userinfo, at, _ = rest.partition("/")[0].rpartition("@")
    return f"{scheme}{sep}***@{rest[len(userinfo) + 1 :]}" if at else url
