"""`usage.prompt_tokens_details.cached_tokens` of segmented requests over HTTP (issue 44,
item 8): a cold blended request, whose segments its own prefills computed, reports none;
the same documents again report what was found stored, as /metrics counts it."""

from __future__ import annotations

import pytest

from tests.server.server_helpers import MODEL_NAME, scrape, value

pytestmark = pytest.mark.timeout(120)

# Text no other test sends, so that nothing of it is cached before this test.
SYSTEM = "Quartz lanterns hum beside the violet harbour of Ostrelund every evening. "
DOCS = [
    "The marmalade archive of Velkin keeps ninety copper ledgers about tidal clocks and amber weights. ",
    "Seven heron pilots of Drumcaster chart fog corridors with brass kites and juniper smoke signals. ",
]
QUESTION = "Who charts the fog corridors?"


def cached_tokens(http, parts: list[str]) -> int:
    response = http.post("/v1/completions", json={
        "model": MODEL_NAME, "segments": parts, "max_tokens": 2, "temperature": 0, "ignore_eos": True})
    assert response.status_code == 200, response.text
    return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def loaded(before, after) -> float:
    """Blended prompt tokens /metrics says were found stored: the prefix hit and the
    reused tokens whose segment was on the device or in a tier."""
    def delta(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    reused = sum(delta("kvtier:blend_reused_tokens", source=s) for s in ("device", "cpu", "disk", "redis"))
    return delta("kvtier:blend_prefix_hit_tokens") + reused


def test_a_cold_blended_request_reports_no_cached_tokens(http):
    before = scrape(http)
    cold = cached_tokens(http, [SYSTEM, *DOCS, QUESTION])
    after = scrape(http)
    assert value(after, "kvtier:blend_reused_tokens", source="computed") > value(
        before, "kvtier:blend_reused_tokens", source="computed")
    assert cold == 0

    before = scrape(http)
    warm = cached_tokens(http, [SYSTEM, DOCS[1], DOCS[0], QUESTION])  # the same documents, another order
    after = scrape(http)
    assert warm == loaded(before, after) > 0
