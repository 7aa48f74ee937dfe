"""The reliability scorecard: what every scenario test measured, as JSON, and its
rendering into docs/RELIABILITY.md.

The tests add one entry per scenario (`Scorecard.add`); the session writes them to
`$KVTIER_RELIABILITY_JSON` (default: the pytest temp dir, printed at the end). Then

    python tests/reliability/scorecard.py RESULTS.json docs/RELIABILITY.md

replaces the text between the scorecard markers of the report with the tables.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

START_MARKER = "<!-- scorecard:start -->"
END_MARKER = "<!-- scorecard:end -->"
Detail = int | float | str


@dataclass
class Entry:
    """One scenario: the requests (or other inputs) it sent, the faults it injected (kills,
    pauses, damaged or forged records, hostile inputs, failing requests), and what came
    out. None means "not applicable": `lost_records` / `torn_records` where the scenario
    keeps nothing it promised (e.g. a Redis restarted empty may lose everything),
    `leaked_blocks` (device blocks still held once idle) where no engine is checked."""

    group: str
    scenario: str
    requests: int
    wrong_outputs: int
    faults: int | None = None
    leaked_blocks: int | None = None
    lost_records: int | None = None
    torn_records: int | None = None
    recovery_s: float | None = None
    details: dict[str, Detail] = field(default_factory=dict)


class Scorecard:
    def __init__(self) -> None:
        self.entries: list[Entry] = []

    def add(
        self,
        group: str,
        scenario: str,
        *,
        requests: int,
        wrong_outputs: int,
        faults: int | None = None,
        leaked_blocks: int | None = None,
        lost_records: int | None = None,
        torn_records: int | None = None,
        recovery_s: float | None = None,
        **details: Detail,
    ) -> None:
        self.entries.append(
            Entry(group, scenario, requests, wrong_outputs, faults, leaked_blocks, lost_records,
                  torn_records, recovery_s, details)
        )

    def write(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps([asdict(e) for e in self.entries], indent=2) + "\n")


def load(path: Path) -> list[Entry]:
    return [Entry(**raw) for raw in json.loads(path.read_text())]


def _cell(value: Detail | None) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value)


def render(entries: list[Entry]) -> str:
    """The scorecard table, its totals, and one line of measurements per scenario."""
    lines = [
        "| group | scenario | requests / inputs | faults injected | wrong outputs | leaked blocks "
        "| lost records | torn records | recovery (s) |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for e in entries:
        cells = [e.group, e.scenario, e.requests, e.faults, e.wrong_outputs, e.leaked_blocks,
                 e.lost_records, e.torn_records, e.recovery_s]
        lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    totals = [sum(getattr(e, name) or 0 for e in entries)
              for name in ("requests", "faults", "wrong_outputs", "leaked_blocks", "lost_records", "torn_records")]
    lines.append(f"| **total** | {len(entries)} scenarios | " + " | ".join(map(str, totals)) + " | |")
    lines += ["", "Measurements per scenario:", ""]
    for e in entries:
        details = ", ".join(f"{k} = {_cell(v)}" for k, v in e.details.items())
        lines.append(f"- **{e.group} / {e.scenario}**: {details or 'none'}")
    return "\n".join(lines)


def update_document(results: Path, document: Path) -> None:
    text = document.read_text()
    head, start, rest = text.partition(START_MARKER)
    _, end, tail = rest.partition(END_MARKER)
    if not start or not end:
        raise SystemExit(f"{document} has no {START_MARKER} ... {END_MARKER} section")
    table = render(load(results))
    document.write_text(f"{head}{START_MARKER}\n{table}\n{END_MARKER}{tail}")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit("usage: python tests/reliability/scorecard.py RESULTS.json REPORT.md")
    update_document(Path(sys.argv[1]), Path(sys.argv[2]))
