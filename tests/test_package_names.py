"""Our top-level packages must not share a name with another installed distribution's:
Python imports whichever comes first on sys.path, so a library that imports its own
package of that name gets ours (transformers 5.25 imports Hugging Face's `kernels`)."""

import importlib
import importlib.metadata
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def top_level_packages() -> list[str]:
    with open(ROOT / "pyproject.toml", "rb") as f:
        patterns = tomllib.load(f)["tool"]["setuptools"]["packages"]["find"]["include"]
    return [pattern.rstrip("*") for pattern in patterns]


def test_no_installed_distribution_ships_a_package_of_ours() -> None:
    providers = importlib.metadata.packages_distributions()
    others = {name: set(providers.get(name, [])) - {"kvtier"} for name in top_level_packages()}
    assert {name: sorted(dists) for name, dists in others.items() if dists} == {}


def test_packages_import_from_this_tree() -> None:
    for name in top_level_packages():
        module = importlib.import_module(name)
        assert Path(module.__file__).resolve().parent == ROOT / name
