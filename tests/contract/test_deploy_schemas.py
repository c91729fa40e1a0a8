"""The shipped deployment files, checked against what they drive (no cluster here; which services and users they
name: tests/integration/test_deploy_files.py):
- every Kubernetes manifest in infra/k8s/ validates, strictly, against the Kubernetes API schemas
  (`kubernetes-validate`, schemas bundled in the package; nats-values.yaml is Helm values, not a manifest);
- every command they run (k8s, systemd, compose) is an entry point that exists, with flags its parser takes;
- every FLIGHTDECK_* variable they set is one the code reads (the code's string constants are the one list of
  names), or one their own command line expands;
- every Secret and ConfigMap a pod names is shipped or marked optional, every flightdeck image is this version,
  and a pod that writes a hostPath as a non-root user is given that folder first."""

import argparse
import ast
import re
import shlex
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from flightdeck.services import registry
from flightdeck.services.agent import bootstrap
from flightdeck.services.shell.security.__main__ import build_parser
from flightdeck.services.tools.console.__main__ import commands as cli_commands

ROOT = Path(__file__).resolve().parents[2]
INFRA = ROOT / "infra"
K8S_VERSION = "1.31.0"
HELM_VALUES = {"nats-values.yaml"}  # values for the NATS Helm chart, not a Kubernetes object
CODE = ("events", "services", "trainer", "flightdeck")
VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]


def manifests() -> Iterator[tuple[str, dict[str, Any]]]:
    for path in sorted((INFRA / "k8s").glob("*.yaml")):
        if path.name not in HELM_VALUES:
            for doc in yaml.safe_load_all(path.read_text()):
                if doc:
                    yield f"{path.name}:{doc['kind']}/{doc['metadata']['name']}", doc


def pod_specs() -> Iterator[tuple[str, dict[str, Any]]]:
    for where, doc in manifests():
        template = doc.get("spec", {}).get("template")
        if template:
            yield where, template["spec"]


def code_variables() -> set[str]:
    """Every FLIGHTDECK_* name the code spells as a string constant: the names it reads (or sets for its ranks)."""
    names: set[str] = set()
    for package in CODE:
        for path in (ROOT / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Constant) and isinstance(node.value, str):
                    names |= set(re.findall(r"\bFLIGHTDECK_[A-Z0-9_]+\b", node.value))
    return names


def systemd_units() -> list[Path]:
    return sorted((INFRA / "systemd").glob("*.service"))


def systemd_lines(path: Path) -> list[str]:
    """The unit's lines with continuations joined."""
    return path.read_text().replace("\\\n", " ").splitlines()


def compose() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load((INFRA / "compose.yaml").read_text())
    return data


def commands() -> list[tuple[str, list[str]]]:
    """(where, argv) of every command the deployment files run, shell expansions replaced by a placeholder."""
    out: list[tuple[str, list[str]]] = []
    for where, spec in pod_specs():
        for c in [*spec.get("initContainers", []), *spec["containers"]]:
            argv = [*c.get("command", []), *c.get("args", [])]
            if argv[:2] == ["sh", "-c"]:
                argv = _split(argv[2])
            out.append((f"{where} {c['name']}", argv))
    for unit in systemd_units():
        for line in systemd_lines(unit):
            if line.startswith("ExecStart="):
                out.append((unit.name, _split(line.removeprefix("ExecStart="))))
    for name, svc in compose()["services"].items():
        if "command" in svc and svc.get("image", "").startswith("${FLIGHTDECK_IMAGE"):
            out.append((f"compose.yaml {name}", list(svc["command"])))
    return out


def _split(line: str) -> list[str]:
    line = re.sub(r'"?\$\([^)]*\)"?', "X", line)  # $(...) command substitutions
    line = re.sub(r"\$\{?[A-Za-z_][A-Za-z0-9_]*\}?|%[a-zA-Z]", "X", line)  # $VAR, ${VAR}, systemd %l
    return [t for t in shlex.split(line) if t != "exec"]


def _parses(parser: argparse.ArgumentParser, args: list[str]) -> str | None:
    try:
        parser.parse_args(args)
    except SystemExit:
        return f"{parser.prog} refuses {args}"
    return None


@pytest.mark.parametrize(("where", "doc"), list(manifests()), ids=[w for w, _ in manifests()])
def test_every_manifest_is_valid_against_the_kubernetes_schemas(where: str, doc: dict[str, Any]) -> None:
    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_a_manifest_with_an_unknown_field_is_refused() -> None:
    """The check can fail: a typo in a container's field is caught."""
    _, doc = next(manifests_of_kind("DaemonSet"))
    doc["spec"]["template"]["spec"]["containers"][0]["envFromm"] = []
    with pytest.raises(kubernetes_validate.ValidationError, match="envFromm"):
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def manifests_of_kind(kind: str) -> Iterator[tuple[str, dict[str, Any]]]:
    return ((w, d) for w, d in manifests() if d["kind"] == kind)


def test_every_command_is_an_entry_point_that_takes_its_flags() -> None:
    services = set(registry.names())
    verbs = {c.name for c in cli_commands()}
    agent_parser = argparse.ArgumentParser(prog="python -m flightdeck.services.agent", exit_on_error=False)
    bootstrap.add_arguments(agent_parser)
    security_parser = build_parser()
    security_parser.exit_on_error = False
    problems: list[str] = []
    seen: set[str] = set()
    for where, argv in commands():
        if argv and argv[0] in ("flightdeck",):
            seen.add("flightdeck")
            if argv[1] not in verbs:
                problems.append(f"{where}: no flightdeck verb {argv[1]!r}")
        elif argv and argv[0].endswith("nats-server"):
            seen.add("nats-server")
        elif argv and argv[0] == "chown":  # an init container handing a host folder over (checked below)
            seen.add("chown")
        elif "-m" in argv:
            module, rest = argv[argv.index("-m") + 1], argv[argv.index("-m") + 2:]
            seen.add(module)
            if module == "flightdeck.services":
                if rest[:1] == [] or rest[0] not in services:
                    problems.append(f"{where}: `python -m {module} {' '.join(rest)}` names no service of {services}")
            elif module == "flightdeck.services.agent":
                if (problem := _parses(agent_parser, rest)) is not None:
                    problems.append(f"{where}: {problem}")
            elif module == "flightdeck.services.shell.security":
                if (problem := _parses(security_parser, rest)) is not None:
                    problems.append(f"{where}: {problem}")
            else:
                problems.append(f"{where}: unknown module {module}")
        else:
            problems.append(f"{where}: not a command we ship: {argv}")
    assert problems == []
    assert {"flightdeck.services", "flightdeck.services.agent", "flightdeck"} <= seen, seen  # each kind checked


def _set_variables() -> Iterator[tuple[str, str, str]]:
    """(where, name, the command lines of that file) for every variable a deployment file sets."""
    for where, spec in pod_specs():
        for c in spec["containers"]:
            for env in c.get("env", []):
                yield where, env["name"], " ".join([*c.get("command", []), *c.get("args", [])])
    for where, doc in manifests_of_kind("ConfigMap"):
        for name in doc.get("data", {}):
            yield where, name, ""
    for unit in systemd_units():
        lines = systemd_lines(unit)
        execs = " ".join(line for line in lines if line.startswith("ExecStart="))
        for line in lines:
            if line.startswith("Environment="):
                yield unit.name, line.removeprefix("Environment=").split("=", 1)[0], execs
    agent_exec = " ".join(line for line in systemd_lines(INFRA / "systemd" / "flightdeck-agent.service")
                          if line.startswith("ExecStart="))
    for line in (INFRA / "systemd" / "flightdeck.env.example").read_text().splitlines():
        if line and not line.startswith("#"):
            yield "flightdeck.env.example", line.split("=", 1)[0], agent_exec
    for name, svc in compose()["services"].items():
        for var in svc.get("environment", {}):
            yield f"compose.yaml {name}", var, " ".join(svc.get("command", []))


def test_every_variable_the_files_set_is_one_the_code_reads() -> None:
    known = code_variables()
    assert {"FLIGHTDECK_NATS_URL", "FLIGHTDECK_OBJECTS", "FLIGHTDECK_NATS_PASSWORD_FILE"} <= known
    unread = sorted({f"{where}: {name}" for where, name, cmd in _set_variables()
                     if name.startswith("FLIGHTDECK_") and name not in known and name not in cmd})
    assert unread == []


def test_a_misspelled_variable_would_be_caught() -> None:
    assert "FLIGHTDECK_NATS_PASWORD_FILE" not in code_variables()


def test_every_secret_and_config_map_a_pod_names_is_shipped_or_optional() -> None:
    shipped = {(d["kind"], d["metadata"]["name"]) for _, d in manifests()}
    missing: list[str] = []
    for where, spec in pod_specs():
        refs: list[tuple[str, str, bool]] = []
        for c in [*spec.get("initContainers", []), *spec["containers"]]:
            for src in c.get("envFrom", []):
                for kind, key in (("Secret", "secretRef"), ("ConfigMap", "configMapRef")):
                    if key in src:
                        refs.append((kind, src[key]["name"], src[key].get("optional", False)))
            for env in c.get("env", []):
                ref = env.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    refs.append(("Secret", ref["name"], ref.get("optional", False)))
        for vol in spec.get("volumes", []):
            if "secret" in vol:
                refs.append(("Secret", vol["secret"]["secretName"], vol["secret"].get("optional", False)))
            if "configMap" in vol:
                refs.append(("ConfigMap", vol["configMap"]["name"], vol["configMap"].get("optional", False)))
        missing += [f"{where}: {kind} {name}" for kind, name, optional in refs
                    if not optional and (kind, name) not in shipped]
    assert missing == []


def test_every_flightdeck_image_is_this_version() -> None:
    images = {c["image"] for _, spec in pod_specs() for c in [*spec.get("initContainers", []), *spec["containers"]]}
    images |= {svc["image"] for svc in compose()["services"].values() if "flightdeck" in svc.get("image", "")}
    ours = {i for i in images if "flightdeck" in i}
    tagged = (f"flightdeck:{VERSION}", f"flightdeck:{VERSION}}}")  # compose: ${FLIGHTDECK_IMAGE:-flightdeck:V}
    assert ours and all(i.endswith(tagged) for i in ours), ours


def test_a_non_root_pod_that_writes_a_host_folder_is_given_it_first() -> None:
    """The image runs as an unprivileged user; a hostPath the kubelet creates belongs to root."""
    checked = 0
    for where, spec in pod_specs():
        host = {v["name"]: v["hostPath"]["path"] for v in spec.get("volumes", []) if "hostPath" in v}
        if not host:
            continue
        checked += 1
        user = spec.get("securityContext", {}).get("runAsUser")
        assert user and user != 0 and spec["securityContext"].get("runAsNonRoot"), where
        given = {m["mountPath"] for c in spec.get("initContainers", []) for m in c.get("volumeMounts", [])
                 if m["name"] in host and "chown" in c.get("command", []) + c.get("args", [])
                 and f"{user}:{user}" in " ".join(c.get("command", []) + c.get("args", []))}
        assert given, f"{where}: no init container gives {sorted(host.values())} to uid {user}"
    assert checked >= 1
