"""The wheel's package list (pyproject.toml) names every package folder under its flightdeck.* name: setuptools
installs only what the list names, so a new folder left out would be missing from an installed Flightdeck alone
(tests/e2e/test_wheel.py builds and runs the wheel)."""

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SETUPTOOLS = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def test_every_package_folder_is_in_the_wheel_under_flightdeck() -> None:
    found = {"flightdeck"}
    for name, folder in SETUPTOOLS["package-dir"].items():
        if name != "flightdeck":
            found |= {".".join((name, *init.parent.relative_to(ROOT / folder).parts))
                      for init in (ROOT / folder).rglob("__init__.py")}
    assert found - set(SETUPTOOLS["packages"]) == set()


def test_each_listed_package_is_a_folder_here() -> None:
    dirs = SETUPTOOLS["package-dir"]
    for name in SETUPTOOLS["packages"]:
        root = max((n for n in dirs if name == n or name.startswith(n + ".")), key=len)
        folder = ROOT / dirs[root] / Path(*name.removeprefix(root).strip(".").split(".") if name != root else ())
        assert folder.is_dir(), name


def test_the_checkout_imports_as_the_wheel_does() -> None:
    """flightdeck/events, /services and /trainer link to the folders, so tools that read the tree (mypy, a bare
    checkout's python -m) see the installed names."""
    for name in ("events", "services", "trainer"):
        link = ROOT / "flightdeck" / name
        assert link.is_symlink() and link.resolve() == ROOT / name
