"""The deployment files name every service of services/registry.py, each with its own NATS user and secret,
so a new service or a renamed one cannot be left out of compose, Kubernetes or systemd."""

import configparser
from pathlib import Path
from typing import Any

import yaml

from flightdeck.services.registry import BUILTIN
from flightdeck.services.shell.security import permissions

INFRA = Path(__file__).resolve().parents[2] / "infra"
PASSWORD_FILE = "FLIGHTDECK_NATS_PASSWORD_FILE"


def load_all(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def k8s() -> list[dict[str, Any]]:
    return [d for p in sorted((INFRA / "k8s").glob("*.yaml")) if p.name != "nats-values.yaml" for d in load_all(p)]


def env_of(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in container.get("env", [])}


def test_compose_runs_nats_every_service_and_an_agent_each_as_its_own_user() -> None:
    compose = yaml.safe_load((INFRA / "compose.yaml").read_text())
    services = compose["services"]
    assert "nats" in services and "agent" in services
    for name in BUILTIN:
        svc = services[name]
        assert svc["command"] == ["python", "-m", "flightdeck.services", name]
        assert svc["environment"]["FLIGHTDECK_NATS_USER"] == name
        assert svc["environment"][PASSWORD_FILE] == f"/run/secrets/{name}"
        assert svc["secrets"] == [name]
        assert compose["secrets"][name]["file"] == f"./secrets/{name}.password"
    agent = services["agent"]
    assert agent["command"][:3] == ["python", "-m", "flightdeck.services.agent"]
    user = agent["environment"]["FLIGHTDECK_NATS_USER"]
    assert user == permissions.agent_user(agent["command"][agent["command"].index("--node") + 1])
    assert not any(k.startswith("FLIGHTDECK_JOB") for k in agent["environment"])  # its ranks get no credential
    assert (INFRA / compose["services"]["nats"]["volumes"][0].split(":")[0].removeprefix("./")).exists()


def test_kubernetes_has_a_singleton_deployment_and_a_secret_per_service() -> None:
    docs = k8s()
    deployments = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Deployment"}
    secrets = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Secret"}
    assert set(deployments) == {f"flightdeck-{s}" for s in BUILTIN}
    for name in BUILTIN:
        spec = deployments[f"flightdeck-{name}"]["spec"]
        assert spec["replicas"] == 1 and spec["strategy"]["type"] == "Recreate"  # never two on one durable
        pod = spec["template"]["spec"]
        (container,) = pod["containers"]
        assert container["args"] == ["python", "-m", "flightdeck.services", name]
        env = env_of(container)
        assert env["FLIGHTDECK_NATS_USER"] == name
        folder, key = env[PASSWORD_FILE].rsplit("/", 1)
        (volume,) = [m["name"] for m in container["volumeMounts"] if m["mountPath"] == folder]
        (secret,) = [v["secret"]["secretName"] for v in pod["volumes"] if v["name"] == volume]
        assert secret == f"flightdeck-nats-{name}" and key in secrets[secret]["stringData"]
    assert {f"flightdeck-nats-{u}" for u in (*BUILTIN, permissions.AGENT, permissions.ADMIN)} <= set(secrets)


def test_kubernetes_runs_the_agent_on_every_gpu_node_and_nats_from_its_helm_chart() -> None:
    (agent,) = [d for d in k8s() if d["kind"] == "DaemonSet"]
    pod = agent["spec"]["template"]["spec"]
    assert "nvidia.com/gpu" in " ".join(pod["nodeSelector"]) and pod["hostNetwork"] is True
    assert any(t["key"] == "nvidia.com/gpu" for t in pod["tolerations"])
    (container,) = pod["containers"]
    assert "flightdeck.services.agent" in " ".join(container["args"])
    assert env_of(container)["FLIGHTDECK_NATS_USER"] == permissions.AGENT
    assert "nvidia.com/gpu" in container["resources"]["limits"]
    values = yaml.safe_load((INFRA / "k8s" / "nats-values.yaml").read_text())
    assert values["config"]["cluster"] == {**values["config"]["cluster"], "enabled": True, "replicas": 3}
    assert values["config"]["jetstream"]["enabled"] is True
    assert values["config"]["jetstream"]["merge"]["sync_interval"] == "always"


def test_systemd_has_a_unit_per_service_and_the_agent() -> None:
    for name, user in [*((s, s) for s in BUILTIN), ("agent", "agent-%l")]:
        unit = configparser.ConfigParser(strict=False, interpolation=None)
        unit.optionxform = str  # type: ignore[assignment,method-assign]  # keys are case-sensitive
        path = INFRA / "systemd" / f"flightdeck-{name}.service"
        unit.read_string(path.read_text().replace("\\\n", " "))
        service = unit["Service"]
        target = "flightdeck.services" if name != "agent" else "flightdeck.services.agent"
        assert f"-m {target} {name if name != 'agent' else ''}".strip() in service["ExecStart"], path
        assert service["Restart"] == "always" and service["EnvironmentFile"].startswith("/etc/flightdeck/")
        text = path.read_text()
        assert f"Environment=FLIGHTDECK_NATS_USER={user}\n" in text
        assert f"LoadCredential=nats-password:/etc/flightdeck/secrets/{user}.password\n" in text
        assert f"Environment={PASSWORD_FILE}=%d/nats-password\n" in text
    units = {p.stem.removeprefix("flightdeck-") for p in (INFRA / "systemd").glob("flightdeck-*.service")}
    assert units == {*BUILTIN, "agent", "nats"}
