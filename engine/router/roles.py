"""Which instance may play which part of prefill/decode disaggregation, by its --kv-role
(GET /instance): a prefill instance must save what it computes (not a consumer), a
decode instance must load it (not a producer). The router refuses a misplaced one at
start, with the flag to fix, and keeps one that comes up misplaced later out of its pool."""

from __future__ import annotations

import httpx
from pydantic import ValidationError

from engine.config import ConfigError, RouterConfig
from engine.server.instance_info import InstanceInfo

# the part (as its flag's option), the role it may not have, and why
_REFUSED = (
    ("prefill_urls", "consumer", "a consumer never saves, so no decode instance could load its prefill"),
    ("decode_urls", "producer", "a producer never loads, so it would recompute every prompt"),
)
CHECK_TIMEOUT_S = 5.0


def role_conflict(config: RouterConfig, url: str, info: InstanceInfo) -> ConfigError | None:
    """Why the instance at `url` cannot play the part the router gives it, or None."""
    for option, role, why in _REFUSED:
        if url in getattr(config, option) and info.kv_role == role:
            return ConfigError(option, f"{url} is --kv-role {role}: {why}")
    return None


def check_roles(config: RouterConfig) -> None:
    """Raise ConfigError for the first misplaced instance among those answering now (one
    that does not answer is checked when it joins the pool)."""
    if not config.prefill_urls:
        return
    with httpx.Client(timeout=CHECK_TIMEOUT_S) as client:
        for url in config.all_urls:
            try:
                info = InstanceInfo.model_validate_json(client.get(f"{url}/instance").content)
            except (httpx.HTTPError, ValidationError):
                continue
            conflict = role_conflict(config, url, info)
            if conflict is not None:
                raise conflict
