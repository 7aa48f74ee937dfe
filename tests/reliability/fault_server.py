"""`kvtier serve` whose model fails on POISON_TOKEN (reliability_support.PoisonedModel).

    python tests/reliability/fault_server.py [kvtier serve flags]

The engine loads its model through `engine.llm_engine.load_model`; this launcher wraps
what that returns, and everything else is the real server.
"""

from __future__ import annotations

import sys
from typing import Any

from reliability_support import PoisonedModel

import engine.llm_engine
from engine.cli import main

_load_model = engine.llm_engine.load_model


def load_poisoned_model(*args: Any, **kwargs: Any) -> tuple[PoisonedModel, Any]:
    model, spec = _load_model(*args, **kwargs)
    return PoisonedModel(model), spec


if __name__ == "__main__":
    engine.llm_engine.load_model = load_poisoned_model
    sys.exit(main(["serve", *sys.argv[1:]]))
