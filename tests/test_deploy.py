"""The operations kit: alert rules, dashboard, image and manifests pass the tools people use.

External tools: ``promtool`` (Debian's ``prometheus`` package, installed by ``.ci/run``),
``hadolint`` and ``kubernetes-validate`` (PyPI, in the ``test`` extra). A test whose tool is
missing is skipped with the reason, except under ``CI=true``, where it fails.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest
import yaml

from proxy.config import parse_config
from tests.conftest import REPO, route
from tests.test_reload import CHAT, until

DEPLOY = REPO / "deploy"
RULES = DEPLOY / "prometheus" / "sluice-rules.yaml"
DASHBOARD = DEPLOY / "grafana" / "sluice-dashboard.json"
K8S = DEPLOY / "kubernetes"
README = (REPO / "README.md").read_text()
#: The oldest Kubernetes that runs native sidecars by default (beta in 1.29, GA in 1.33).
K8S_VERSION = "1.29.0"

#: The SPEC's metrics. Those that other issues add are used by the rules and the dashboard
#: before a Sluice of this branch exports them.
SPEC_METRICS = {
    "sluice_requests_total", "sluice_rejections_total", "sluice_inflight_requests",
    "sluice_queue_depth", "sluice_queue_wait_seconds", "sluice_upstream_duration_seconds",
    "sluice_upstream_attempts_total", "sluice_work_units_total", "sluice_retries_total",
    "sluice_circuit_state", "sluice_tokens_total", "sluice_cost_usd_total",
    "sluice_budget_remaining", "sluice_idempotent_replays_total", "sluice_dead_letters_total",
}
FROM_OTHER_ISSUES = {
    "sluice_upstream_attempts_total", "sluice_work_units_total", "sluice_retries_total",
    "sluice_circuit_state", "sluice_dead_letters_total",  # issue 5
    "sluice_tokens_total", "sluice_cost_usd_total",  # issue 3
    "sluice_idempotent_replays_total",  # issue 4
}
#: Exported with ``state.backend: redis`` only (the key faults at 0 for each kind from the
#: start; the eviction gauges once Redis's INFO has been read).
REDIS_ONLY = {"sluice_state_key_faults_total", "sluice_state_evicting_policy",
              "sluice_state_redis_evicted_keys_total"}
_METRIC = re.compile(r"(?<![\w:])sluice_[a-z_]+(?![\w:])")


def tool(name: str) -> str:
    """The path of an external tool; skip (or fail under CI=true) when it is not installed."""
    path = shutil.which(name, path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    if path is None:
        message = f"{name} is not installed (.ci/run installs it)"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    return path


def run(*args: str, stdin: str | None = None, cwd: Path = REPO) -> subprocess.CompletedProcess:
    result = subprocess.run(args, cwd=cwd, input=stdin, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, f"{' '.join(args)}:\n{result.stdout}\n{result.stderr}"
    return result


def metric_names(expr: str) -> set[str]:
    """Series names used in a PromQL expression, histogram suffixes folded to the family."""
    return {re.sub(r"_(bucket|sum|count)$", "", n) for n in _METRIC.findall(expr)}


def dashboard_exprs() -> list[str]:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    return [t["expr"] for p in panels for t in p.get("targets", [])]


def rule_exprs() -> list[str]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [rule["expr"] for group in groups for rule in group["rules"]]


# --- Prometheus --------------------------------------------------------------------------------

def test_alert_rules_check_and_unit_tests():
    promtool = tool("promtool")
    assert "SUCCESS: 19 rules found" in run(promtool, "check", "rules", str(RULES)).stdout
    run(promtool, "test", "rules", "sluice-rules.test.yaml", cwd=RULES.parent)


def test_rules_cover_the_issues_alerts():
    alerts = {rule.get("alert") for g in yaml.safe_load(RULES.read_text())["groups"]
              for rule in g["rules"]}
    assert {"SluiceAmplificationRising", "SluiceDeadLettersGrowing", "SluiceCircuitOpen",
            "SluiceOperationCircuitOpen", "SluiceQueueWaitNearMaxWait",
            "SluiceBudgetNearExhaustion",
            "SluiceStateBackendDown", "SluiceStateKeyFaults", "SluiceStateRedisEvicting",
            "SluiceStateRedisKeysEvicted", "SluiceOutputDropped",
            "SluiceConfigRestartPending"} <= alerts


def test_dashboard_queries_parse_and_cover_the_spec(tmp_path):
    promtool = tool("promtool")
    exprs = dashboard_exprs()
    used = set().union(*map(metric_names, exprs))
    assert used >= SPEC_METRICS, f"dashboard lacks {sorted(SPEC_METRICS - used)}"
    # promtool has no offline query parser, but it parses every rule's expression.
    rules = {"groups": [{"name": "dashboard", "rules": [
        {"record": f"dashboard:panel_{i}", "expr": e.replace("$__rate_interval", "5m")
         .replace("$route", ".*")} for i, e in enumerate(exprs)]}]}
    path = tmp_path / "dashboard-rules.yaml"
    path.write_text(yaml.safe_dump(rules))
    run(promtool, "check", "rules", str(path))
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] == "sluice-overview"
    assert [v["name"] for v in dashboard["templating"]["list"]] == ["datasource", "route"]


def _panel_targets(title: str) -> dict[str, str]:
    (panel,) = (p for p in json.loads(DASHBOARD.read_text())["panels"]
                if p["title"].startswith(title))
    return {t["refId"]: t["expr"].replace('=~"$route"', '=~".*"') for t in panel["targets"]}


def test_saturation_panels_are_true_for_replicas_on_either_backend(tmp_path):
    """Two replicas of a route with concurrency.limit 4 (or 8 with Redis) and a queue of 5 each.
    With the memory backend each replica has its own limit, so together they have 8 slots;
    with Redis they share the 8. Queues are each replica's own on either backend, so the panel
    compares the fullest one (full: pod-b refuses queue_full) with the capacity of one. An
    MCP GET stream is a request in flight holding no slot: the in-flight panel leaves out
    ``sluice_open_streams`` (pod-a has one), and still reads replicas that export no such
    gauge (a Sluice from before it)."""
    promtool = tool("promtool")
    inflight, queue = _panel_targets("In flight vs"), _panel_targets("Queue depth vs")
    rules = {"groups": [{"name": "panels", "rules": [
        {"record": "panel:inflight", "expr": inflight["A"]},
        {"record": "panel:limit", "expr": inflight["B"]},
        {"record": "panel:queued", "expr": queue["A"]},
        {"record": "panel:capacity", "expr": queue["B"]}]}]}
    (tmp_path / "panels.yaml").write_text(yaml.safe_dump(rules))

    def replicas(backend: str, limit: int, streams: bool) -> dict:
        series = []
        for pod, inflight_now, queued in (("pod-a", 3, 2), ("pod-b", 4, 5)):
            labels = f'instance="{pod}:9901",job="sluice"'
            if streams:
                open_streams = int(pod == "pod-a")
                inflight_now += open_streams
                series.append({"series": f'sluice_open_streams{{{labels},route="openai"}}',
                               "values": f"{open_streams}x5"})
            series += [
                {"series": f'sluice_state_backend_up{{{labels},backend="{backend}"}}',
                 "values": "1x5"},
                {"series": f'sluice_inflight_requests{{{labels},route="openai"}}',
                 "values": f"{inflight_now}x5"},
                {"series": f'sluice_concurrency_limit{{{labels},route="openai"}}',
                 "values": f"{limit}x5"},
                {"series": f'sluice_queue_depth{{{labels},route="openai"}}',
                 "values": f"{queued}x5"},
                {"series": f'sluice_queue_limit{{{labels},route="openai"}}', "values": "5x5"},
            ]
        expected = {"inflight": 7, "limit": 8, "queued": 5, "capacity": 5}
        return {"interval": "1m", "input_series": series, "promql_expr_test": [
            {"expr": f"panel:{name}", "eval_time": "2m",
             "exp_samples": [{"labels": f'panel:{name}{{route="openai"}}', "value": value}]}
            for name, value in expected.items()]}

    tests = {"rule_files": ["panels.yaml"], "evaluation_interval": "1m",
             "tests": [replicas(backend, limit, streams) for backend, limit in
                       (("memory", 4), ("redis", 8)) for streams in (True, False)]}
    (tmp_path / "panels.test.yaml").write_text(yaml.safe_dump(tests))
    run(promtool, "test", "rules", "panels.test.yaml", cwd=tmp_path)


async def test_metrics_endpoint_passes_promtool_and_names_are_real(upstream, start_sluice):
    promtool = tool("promtool")
    upstream.hold = asyncio.Event()
    sluice = await start_sluice({"routes": [
        route("llm", upstream.url, concurrency={"limit": 1, "queue": 1, "max_wait": "30s"},
              rate={"requests": "100/min"}),
        # A route-wide budget exports its gauges at once, read by SluiceBudgetNearExhaustion.
        route("plain", upstream.url, budget={"tokens": "1000000/h", "per": "route"}),
        # An operation's breaker exports its state at once, read by SluiceOperationCircuitOpen.
        route("ops", upstream.url, "http",
              endpoints={"POST /x": {"circuit_breaker": {"fail_max": 5}}})]})
    async with aiohttp.ClientSession() as session:
        url = sluice.url + "/llm/v1/chat/completions"
        first = asyncio.create_task(session.post(url, json=CHAT))
        await until(lambda: upstream.inflight == 1)
        second = asyncio.create_task(session.post(url, json=CHAT))
        await sluice.wait_metric("sluice_queue_depth", 1, route="llm")
        async with session.post(url, json=CHAT) as refused:
            assert refused.status == 503
        upstream.hold.set()
        for response in await asyncio.gather(first, second):
            assert response.status == 200
            response.release()
        async with session.get(sluice.admin_url + "/metrics") as r:
            text = await r.text()
    result = run(promtool, "check", "metrics", stdin=text)
    assert result.stdout == "" and result.stderr == ""  # no lint findings at all

    exported = {re.sub(r"_(bucket|sum|count)$", "", line.split("{")[0].split()[0])
                for line in text.splitlines() if line and not line.startswith("#")}
    used = set().union(*map(metric_names, rule_exprs() + dashboard_exprs()))
    unknown = used - exported - FROM_OTHER_ISSUES - REDIS_ONLY
    assert not unknown, f"rules or dashboard use series nothing exports: {sorted(unknown)}"


# --- image -----------------------------------------------------------------------------------

def test_dockerfile_is_hadolint_clean_and_production_shaped():
    run(tool("hadolint"), "Dockerfile")
    text = (REPO / "Dockerfile").read_text()
    bases = re.findall(r"^FROM (\S+)", text, re.M)
    assert len(bases) == 2 and bases[0] == bases[1], "two stages on one exact base"
    assert re.fullmatch(r"python:3\.11\.\d+-slim-\w+(@sha256:[0-9a-f]{64})?", bases[0])
    final = text.split("\nFROM ")[-1]
    assert "COPY --from=build /opt/sluice /opt/sluice" in final
    assert re.search(r"^USER 10001:10001$", final, re.M)
    assert re.search(r"^STOPSIGNAL SIGTERM$", final, re.M)
    assert "HEALTHCHECK" in final and "127.0.0.1:9901/healthz" in final
    assert 'CMD ["serve", "--config", "/etc/sluice/sluice.yaml"]' in final
    assert "pip install" not in final and "apt-get" not in final
    # The build context lets in exactly what the COPY lines need.
    ignore = (REPO / ".dockerignore").read_text().splitlines()
    for source in ("pyproject.toml", "README.md", "proxy/", "policies/",
                   "deploy/docker/sluice.yaml"):
        assert f"!{source}" in ignore
    config = DEPLOY / "docker" / "sluice.yaml"
    parsed = parse_config(config.read_text(), str(config))
    assert parsed.server.admin_listen == "0.0.0.0:9901" and parsed.server.listen == "0.0.0.0:8080"


#: ``docker stop`` and Compose send SIGKILL this long after SIGTERM unless told otherwise.
DOCKER_STOP_TIMEOUT_S = 10
#: What a stop takes after ``drain_timeout``, allowed for: the cut, the answers written, the
#: admin port's and the output's shutdown (a second or two measured; 5 is the README's rule).
SHUTDOWN_AFTER_DRAIN_S = 5


def test_the_images_config_drains_within_docker_stops_grace():
    """A hostile trial: the image's config drained for 30 s and ``docker stop`` killed it at
    10 s, so a call in retry back-off got no answer and no dead letter. The baked drain fits
    the default grace, and the README says how to give a longer one room."""
    config = DEPLOY / "docker" / "sluice.yaml"
    drain = parse_config(config.read_text(), str(config)).server.drain_timeout
    assert drain + SHUTDOWN_AFTER_DRAIN_S <= DOCKER_STOP_TIMEOUT_S
    image = README.split("The image (`Dockerfile`)", 1)[1].split("\n\n", 1)[0]
    assert f"drains for {drain:g} s" in image
    assert f"drain_timeout` + {SHUTDOWN_AFTER_DRAIN_S} s" in image
    assert "--stop-timeout 35" in image and "stop_grace_period: 35s" in image


def test_the_dockerfiles_run_line_gives_a_users_config_its_drain(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A review: the Dockerfile's own usage line mounts the user's config over the baked one
    with no --stop-timeout, while the file users start from (config/sluice.yaml, and the
    Kubernetes ConfigMaps) drains 30 s: docker stop's SIGKILL at 10 s cut the drain. The line
    gives drain_timeout + 5 s, and config/sluice.yaml says so beside its drain_timeout."""
    text = (REPO / "Dockerfile").read_text()
    (line,) = [line for line in text.splitlines() if "docker run" in line]
    assert "/etc/sluice/sluice.yaml" in line
    given = re.search(r"--stop-timeout (\d+)\b", line)
    assert given, line
    grace = int(given[1])
    monkeypatch.setenv("SLUICE_REDIS_URL", "redis://sluice-redis:6379/0")  # read at load
    starts = [REPO / "config" / "sluice.yaml"]
    drains = [parse_config(path.read_text(), str(path)).server.drain_timeout for path in starts]
    for config_map in (K8S / "configmap.yaml", K8S / "redis" / "configmap.yaml"):
        data = yaml.safe_load(config_map.read_text())["data"]["sluice.yaml"]
        drains.append(parse_config(data, str(config_map)).server.drain_timeout)
    assert grace == max(drains) + SHUTDOWN_AFTER_DRAIN_S
    assert "drain_timeout + 5 s" in text
    template = (REPO / "config" / "sluice.yaml").read_text()
    at = template.split("  drain_timeout:", 1)[1].split("\n  max_request_bytes:", 1)[0]
    comment = " ".join(part.split("#", 1)[1].strip() for part in at.splitlines() if "#" in part)
    assert "container" in comment and "drain_timeout + 5 s" in comment
    assert f"--stop-timeout {grace}" in comment


# --- Kubernetes ------------------------------------------------------------------------------

def test_manifests_validate_offline():
    result = run(tool("kubernetes-validate"), "--strict", "-k", K8S_VERSION,
                 *sorted(str(p) for p in K8S.glob("*.yaml")))
    assert result.stdout.count("passed") == 2


def test_dead_letters_on_an_empty_dir_are_said_to_be_lost_at_a_rollout():
    """A hostile trial: the sidecar (memory backend) keeps its dead-letter file on an
    emptyDir, deleted with the pod at every rollout, and neither the manifest nor the README
    said so. Both say it now, and where to keep the letters instead."""
    config_map = yaml.safe_load((K8S / "configmap.yaml").read_text())
    config = parse_config(config_map["data"]["sluice.yaml"], "configmap.yaml")
    text = (K8S / "deployment.yaml").read_text()
    pod = yaml.safe_load(text)["spec"]["template"]["spec"]
    (sidecar,) = pod["initContainers"]
    workdir = sidecar.get("workingDir") or re.findall(
        r"^WORKDIR\s+(\S+)", (REPO / "Dockerfile").read_text(), re.M)[-1]
    letters = Path(workdir, config.dead_letter.path)
    mount = next(m for m in sidecar["volumeMounts"] if letters.is_relative_to(m["mountPath"]))
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    assert config.state.backend == "memory" and "emptyDir" in volume
    above = text.split(f"- name: {volume['name']}\n          emptyDir")[0].rsplit("volumes:")[-1]
    comment = " ".join(" ".join(line.strip().lstrip("#") for line in above.splitlines()
                                if line.strip().startswith("#")).split())
    assert "dead letters" in comment and "every rollout loses them" in comment
    assert "Redis backend" in comment
    deploy = " ".join(README.split("\n## Deploy as a Kubernetes sidecar\n")[1]
                      .split("\n## ")[0].split())
    assert "dead letters (memory backend) are kept on an `emptyDir`, lost with the pod" in deploy
    assert "use the Redis backend" in deploy


def test_sidecar_manifest_fits_sluice_config():
    config_map = yaml.safe_load((K8S / "configmap.yaml").read_text())
    config = parse_config(config_map["data"]["sluice.yaml"], "configmap.yaml")
    pod = yaml.safe_load((K8S / "deployment.yaml").read_text())["spec"]["template"]["spec"]
    (sidecar,) = pod["initContainers"]
    (agent,) = pod["containers"]
    assert sidecar["restartPolicy"] == "Always"
    assert pod["terminationGracePeriodSeconds"] > config.server.drain_timeout
    host, _, admin_port = config.server.admin_listen.rpartition(":")
    assert host == "0.0.0.0"
    (port,) = sidecar["ports"]
    assert port["containerPort"] == int(admin_port)
    for probe, path in (("startupProbe", "/readyz"), ("readinessProbe", "/readyz"),
                        ("livenessProbe", "/healthz")):
        assert sidecar[probe]["httpGet"] == {"path": path, "port": port["name"]}
    assert pod["volumes"][0]["configMap"]["name"] == config_map["metadata"]["name"]
    mount = next(m for m in sidecar["volumeMounts"] if m["name"] == "sluice-config")
    assert "subPath" not in mount  # a subPath mount never sees ConfigMap updates
    assert sidecar["args"][-1] == f"{mount['mountPath']}/sluice.yaml"
    for container in (sidecar, agent):
        assert set(container["resources"]) == {"requests", "limits"}
    # Room for the memory at rest, the bodies held and the parse of the largest one (up to
    # ~34x its size: README, "Memory"): at 256Mi one 16 MiB body was OOM-killed.
    limit = sidecar["resources"]["limits"]["memory"]
    assert limit.endswith(("Mi", "Gi"))
    limit_bytes = int(limit[:-2]) * (2**20 if limit.endswith("Mi") else 2**30)
    server = config.server
    assert limit_bytes >= 70 * 2**20 + server.max_buffered_bytes + 34 * server.max_request_bytes
    env = {e["name"]: e.get("value") for e in agent["env"]}
    prefixes = {r.protocol: r.path_prefix for r in config.routes}
    listen = config.server.listen
    assert env["OPENAI_BASE_URL"] == f"http://{listen}{prefixes['openai']}v1"
    assert env["ANTHROPIC_BASE_URL"] == f"http://{listen}{prefixes['anthropic']}".rstrip("/")
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert sidecar["securityContext"]["readOnlyRootFilesystem"] is True


# --- Kubernetes, shared state on Redis --------------------------------------------------------

REDIS_K8S = K8S / "redis"


def _carried_config(path: Path) -> str:
    return yaml.safe_load(path.read_text())["data"]["sluice.yaml"]


def test_redis_manifests_validate_offline(tmp_path, monkeypatch):
    # As the pod has it (deployment.yaml, from the Secret): check-config reads env:NAME.
    monkeypatch.setenv("SLUICE_REDIS_URL", "redis://sluice-redis:6379/0")
    result = run(tool("kubernetes-validate"), "--strict", "-k", K8S_VERSION,
                 *sorted(str(p) for p in REDIS_K8S.glob("*.yaml")))
    assert result.stdout.count("passed") == 2
    config = tmp_path / "sluice.yaml"
    config.write_text(_carried_config(REDIS_K8S / "configmap.yaml"))
    out = run(tool("sluice"), "check-config", str(config)).stdout
    assert out == f"{config}: ok (2 route(s))\n"


def test_redis_variant_differs_from_the_sidecar_only_in_shared_state(monkeypatch):
    monkeypatch.setenv("SLUICE_REDIS_URL", "redis://sluice-redis:6379/0")
    base = parse_config(_carried_config(K8S / "configmap.yaml"), "configmap.yaml")
    shared = parse_config(_carried_config(REDIS_K8S / "configmap.yaml"), "redis/configmap.yaml")
    assert shared.state.backend == "redis"
    assert shared.state.redis_url == "env:SLUICE_REDIS_URL"
    assert shared.state.on_unavailable in ("local", "reject")
    assert shared.model_copy(update={"state": base.state}) == base

    deployment = yaml.safe_load((REDIS_K8S / "deployment.yaml").read_text())
    sidecar = deployment["spec"]["template"]["spec"]["initContainers"][0]
    (env,) = sidecar.pop("env")
    assert env == {"name": "SLUICE_REDIS_URL",
                   "valueFrom": {"secretKeyRef": {"name": "sluice-redis", "key": "url"}}}
    # Each replica enforces its share of every limit while Redis is away: the share must be
    # of the replicas that really run.
    assert deployment["spec"].pop("replicas") == shared.state.replicas > 1
    base_deployment = yaml.safe_load((K8S / "deployment.yaml").read_text())
    base_deployment["spec"].pop("replicas")
    assert deployment == base_deployment
