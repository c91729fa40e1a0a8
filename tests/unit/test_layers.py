"""The layout's import rules, read from the code: no upward import, no service importing another, no torch or
trainer in the control plane. A new import that breaks one fails here with the module and the line.

Layers, lowest first: events/ (the catalog and the node-local protocol); services/core.py (the core contract)
and services/shell/ (the I/O every process shares); the five services and the node agent, side by side;
services/registry.py and services/__main__.py (which wire the services); services/tools/ (the operator's
tools: tools/cli.py and tools/connect.py, then history/, postmortem/ (goodput's one definition), audit/
(verify, whatif), explore/ (the fault explorer), then client.py (the Python client, also `flightdeck.client`),
web/ (`flightdeck ui`: /metrics), then console/, the CLI built on them).
trainer/ (with flightdeck/, the trainer API's import path) stands beside the control plane and shares only
events/ with it.
"""

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SERVICES = ("scheduler", "resources", "checkpoints", "health", "resharder", "archiver")
# lowest first; cli.py and connect.py sit below. explore (the simulator) checks its runs with the history's views.
TOOLS = ("history", "postmortem", "audit", "explore", "client", "web", "console")
TORCH = ("torch",)
PACKAGES = ("events", "services", "trainer")  # folders installed as flightdeck.events, .services, .trainer


@dataclass(frozen=True)
class Import:
    module: str  # the importing module
    target: str  # what it imports: a module, or a module's attribute as `module.name`
    line: int


def imports_of(module: str, source: str, relative: bool = False) -> list[Import]:
    """Every absolute import in `source`, also those inside functions; `from a import b` as `a.b`. A relative
    import fails unless `relative` (tests import their helpers so), and is then left out."""
    found: list[Import] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [Import(module, a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            assert relative or node.level == 0, f"{module}:{node.lineno}: relative import (write it absolute)"
            if node.level:
                continue
            base = node.module or ""
            found += [Import(module, f"{base}.{a.name}", node.lineno) for a in node.names]
    return found


def place(name: str) -> tuple[str, ...]:
    """Where a dotted name lives: ('events',), ('core',), ('shell',), ('service', NAME), ('agent',), ('wiring',),
    ('tools', RANK, PART), ('trainer',), ('torch',) or ('other',)."""
    parts = name.split(".")
    if parts[0] in PACKAGES:
        return ("bare",)  # installed only as flightdeck.<name>: a bare import works in the checkout alone
    if parts[0] == "flightdeck" and parts[1:2] and parts[1] in PACKAGES:
        parts = parts[1:]
    top = parts[0]
    if top in ("events", "trainer"):
        return (top,)
    if top == "flightdeck" and parts[1:2] == ["client"]:  # the client's import path (services/tools/client.py)
        return ("tools", str(TOOLS.index("client") + 1), "client")
    if top == "flightdeck":  # the trainer API's import path (trainer/api.py), part of the trainer
        return ("trainer",)
    if top in TORCH:
        return ("torch",)
    if top != "services" or len(parts) == 1:
        return ("other",)
    second = parts[1]
    if second == "core":
        return ("core",)
    if second == "shell":
        return ("shell",)
    if second in SERVICES:
        return ("service", second)
    if second == "agent":
        return ("agent",)
    if second in ("registry", "__main__"):
        return ("wiring",)
    if second == "tools":
        part = parts[2] if len(parts) > 2 else ""
        rank = TOOLS.index(part) + 1 if part in TOOLS else 0  # cli.py, connect.py: 0
        return ("tools", str(rank), part)
    return ("other",)


def why_not(imp: Import) -> str:
    """Why `imp` breaks a rule, or ""."""
    src, dst = place(imp.module), place(imp.target)
    if dst == ("bare",):
        return f"import it as flightdeck.{imp.target}: the wheel installs no top-level {imp.target.split('.')[0]}"
    if dst == ("other",):
        return ""  # the standard library and third-party packages (torch is its own place)
    kind, target = src[0], dst[0]
    if kind == "trainer":
        return "the trainer imports no service" if target not in ("events", "trainer", "torch") else ""
    if target == "torch":
        return "the control plane never imports torch"
    if target == "trainer":
        return "nothing outside trainer/ imports the trainer: the node-local protocol is events/nodelocal.py's"
    if kind == "events":
        return "events/ is the lowest layer" if target != "events" else ""
    allowed = {
        "core": {"events", "core"},
        "shell": {"events", "core", "shell"},
        "service": {"events", "core", "shell", "service"},
        "agent": {"events", "core", "shell", "agent"},
        "wiring": {"events", "core", "shell", "service", "agent", "wiring"},
        "tools": {"events", "core", "shell", "service", "agent", "wiring", "tools"},
    }[kind]
    if target not in allowed:
        return f"{'/'.join(src)} may not import {target} (a higher layer or a neighbour)"
    if kind == "service" and target == "service" and src[1] != dst[1]:
        return f"the {src[1]} service imports the {dst[1]} service: move what both need down"
    if kind == "tools" and target == "tools" and int(dst[1]) > int(src[1]):
        return f"tools/{src[2] or '*.py'} imports tools/{dst[2]}, a tool above it"
    return ""


def modules() -> dict[str, str]:
    found = {}
    for top in ("events", "services", "trainer", "flightdeck"):
        for path in sorted((ROOT / top).rglob("*.py")):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
            found[name if top == "flightdeck" else f"flightdeck.{name}"] = path.read_text()
    return found


def test_the_tree_keeps_its_layers() -> None:
    broken = [f"{i.module}:{i.line} imports {i.target}: {why}"
              for name, source in modules().items() for i in imports_of(name, source) if (why := why_not(i))]
    assert broken == []


def test_every_module_has_a_place() -> None:
    assert [name for name in modules() if place(name) == ("other",) and name != "flightdeck.services"] == []


@pytest.mark.parametrize(("module", "target", "rule"), [
    ("fd.services.scheduler.recipes", "fd.services.checkpoints.core.COMMIT", "imports the checkpoints service"),
    ("fd.services.tools.history.timeline", "fd.services.tools.console.jobview.JobView", "a tool above it"),
    ("fd.services.agent.spawner", "fd.trainer.beats.BEATS_ENV", "nothing outside trainer/"),
    ("fd.services.health.core", "torch", "never imports torch"),
    ("fd.services.shell.runtime", "fd.services.health.core.State", "shell may not import service"),
    ("fd.services.agent.main", "fd.services.checkpoints.service.OBJECTS_ENV", "agent may not import service"),
    ("fd.events.codec", "fd.services.core.Emit", "lowest layer"),
    ("fd.trainer.loop", "fd.services.shell.objects.manifest", "the trainer imports no service"),
    ("fd.services.health.core", "fd.services.registry.BUILTIN", "health may not import wiring"),
    ("fd.services.scheduler.core", "events.codec", "import it as flightdeck.events.codec"),
    ("fd.trainer.loop", "trainer.config.parse", "installs no top-level trainer"),
])
def test_each_rule_catches_what_it_forbids(module: str, target: str, rule: str) -> None:
    """(`fd.` is short for `flightdeck.` here.)"""
    assert rule in why_not(Import(full(module), full(target), 1))


def full(name: str) -> str:
    return "flightdeck." + name.removeprefix("fd.") if name.startswith("fd.") else name


@pytest.mark.parametrize(("module", "target"), [
    ("flightdeck.services.scheduler.recipes", "flightdeck.events.lineage.thrown_away"),
    ("flightdeck.services.tools.console.status", "flightdeck.services.tools.history.jobview.JobView"),
    ("flightdeck.services.tools.audit.verify", "flightdeck.services.checkpoints.core.COMMIT"),
    ("flightdeck.services.agent.spawner", "flightdeck.events.nodelocal.BEATS_ENV"),
    ("flightdeck.trainer.standby", "flightdeck.events.nodelocal.Assignment"),
    ("flightdeck.services.registry", "flightdeck.services.health.service.build"),
])
def test_what_the_layers_allow(module: str, target: str) -> None:
    assert why_not(Import(module, target, 1)) == ""


def test_tests_benchmarks_and_examples_import_the_installed_names() -> None:
    """Outside the package too: a bare `events`/`services`/`trainer` import works from the checkout's root only,
    and loads a second copy of the module beside flightdeck.*'s (two `Event` classes, two registries)."""
    bare = [f"{path.relative_to(ROOT)}:{i.line} imports {i.target}"
            for top in ("tests", "bench", "examples") for path in sorted((ROOT / top).rglob("*.py"))
            for i in imports_of(str(path), path.read_text(), relative=True) if place(i.target) == ("bare",)]
    assert bare == []
