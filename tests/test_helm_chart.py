"""The Helm chart (helm/lathe) and the images (docker/Dockerfile).

The chart is linted (``helm lint --strict``), rendered (``helm template``) and the rendered objects checked against
Kubernetes 1.35's schemas (``kubernetes-validate --strict``) for the default and the multi-pool values, then read
as YAML: the trainer's rank wiring, GPU requests, NetworkPolicies, PDBs, pod security, monitoring objects. helm is
the pinned static binary helm/fetch_helm.py installs into .venv/bin (``make test`` does); without it these tests skip
and say so. No image can be built here (no docker), so the Dockerfile is checked as text: a target per service,
each installing its pyproject extra, non-root, starting a module that exists.
"""

from __future__ import annotations

import base64
import functools
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

from lathe.gateway.auth import ApiKeys

REPO = Path(__file__).resolve().parents[1]
CHART = REPO / "helm" / "lathe"
MULTIPOOL = CHART / "values-gpu-multipool.yaml"
SGLANG = CHART / "values-gpu-sglang.yaml"
K8S_VERSION = "1.35.0"
RELEASE = "rel"


def helm() -> str:
    local = Path(sys.executable).parent / "helm"
    found = str(local) if local.is_file() else shutil.which("helm")
    if found is None:
        pytest.skip("no helm binary: run `python helm/fetch_helm.py` (make test does) to install the pinned one")
    return found


@functools.cache
def render(values: str = "") -> str:
    args = [helm(), "template", RELEASE, str(CHART), "--namespace", "lathe"] + (["-f", values] if values else [])
    return subprocess.run(args, check=True, capture_output=True, text=True, timeout=120).stdout


def objects(values: str = "") -> list[dict]:
    return [d for d in yaml.safe_load_all(render(values)) if d]


def one(objs: list[dict], kind: str, name: str) -> dict:
    found = [o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind} {name}: {[(o['kind'], o['metadata']['name']) for o in objs]}"
    return found[0]


def env_of(container: dict) -> dict[str, object]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


VALUES = pytest.mark.parametrize("values", ["", str(MULTIPOOL), str(SGLANG)],
                                 ids=["default", "gpu-multipool", "gpu-sglang"])


@VALUES
def test_the_chart_lints_strictly(values: str) -> None:
    args = [helm(), "lint", "--strict", str(CHART)] + (["-f", values] if values else [])
    out = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr


@VALUES
def test_the_rendered_objects_are_valid_for_kubernetes_1_35(values: str, tmp_path: Path) -> None:
    rendered = tmp_path / "rendered.yaml"
    rendered.write_text(render(values))
    validate = Path(sys.executable).parent / "kubernetes-validate"
    out = subprocess.run([str(validate), "-k", K8S_VERSION, "--strict", "--quiet", str(rendered)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "ERROR" not in out.stdout + out.stderr


def test_each_trainer_rank_gets_its_ordinal_the_world_size_and_rank_0_as_master() -> None:
    objs = objects(str(MULTIPOOL))
    for pool, gpus, product in (("llama-8b", 1, "NVIDIA-H100-80GB-HBM3"), ("qwen3-32b", 2, "NVIDIA-H200")):
        sts = one(objs, "StatefulSet", f"{RELEASE}-lathe-{pool}-trainer")
        headless = one(objs, "Service", f"{RELEASE}-lathe-{pool}-ranks")
        assert sts["spec"]["replicas"] == 2 and sts["spec"]["serviceName"] == headless["metadata"]["name"]
        assert headless["spec"]["clusterIP"] == "None"
        pod = sts["spec"]["template"]["spec"]
        (c,) = pod["containers"]
        env = env_of(c)
        assert env["RANK"] == {"fieldRef": {"fieldPath": "metadata.labels['apps.kubernetes.io/pod-index']"}}
        assert env["WORLD_SIZE"] == "2" and env["MASTER_PORT"] == "29500"
        assert env["MASTER_ADDR"] == f"{RELEASE}-lathe-{pool}-trainer-0.{RELEASE}-lathe-{pool}-ranks.lathe.svc"
        assert env["NCCL_SOCKET_IFNAME"] == "eth0" and env["NCCL_DEBUG"] == "WARN"
        assert c["resources"]["requests"]["nvidia.com/gpu"] == gpus == c["resources"]["limits"]["nvidia.com/gpu"]
        assert pod["nodeSelector"] == {"nvidia.com/gpu.product": product}
        assert c["image"].endswith("/lathe-trainer-cuda:0.1.0")
        sampler = one(objs, "Deployment", f"{RELEASE}-lathe-{pool}-sampler")["spec"]["template"]["spec"]
        assert sampler["containers"][0]["resources"]["requests"]["nvidia.com/gpu"] == gpus
    default = one(objects(), "StatefulSet", f"{RELEASE}-lathe-smollm2-trainer")
    (c,) = default["spec"]["template"]["spec"]["containers"]
    assert env_of(c)["WORLD_SIZE"] == "1" and "nvidia.com/gpu" not in c["resources"]["limits"]
    assert c["image"].endswith("/lathe-trainer:0.1.0")


def test_pool_containers_get_the_stacks_allocator_settings_and_an_empty_value_drops_them(tmp_path: Path) -> None:
    from lathe.stack import POOL_MALLOC

    objs = objects()
    trainer = one(objs, "StatefulSet", f"{RELEASE}-lathe-smollm2-trainer")["spec"]["template"]["spec"]
    sampler = one(objs, "Deployment", f"{RELEASE}-lathe-smollm2-sampler")["spec"]["template"]["spec"]
    for pod in (trainer, sampler):
        assert env_of(pod["containers"][0])["GLIBC_TUNABLES"] == POOL_MALLOC
    gateway = one(objs, "Deployment", f"{RELEASE}-lathe-gateway")["spec"]["template"]["spec"]
    assert "GLIBC_TUNABLES" not in env_of(gateway["containers"][0])
    checkpoints = one(objs, "Deployment", f"{RELEASE}-lathe-checkpoints")["spec"]["template"]["spec"]
    assert env_of(checkpoints["containers"][0])["GLIBC_TUNABLES"] == POOL_MALLOC
    values = tmp_path / "values.yaml"
    values.write_text('poolDefaults:\n  malloc: ""\ncheckpoints:\n  malloc: ""\n')
    assert "GLIBC_TUNABLES" not in render(str(values))


def test_the_gateway_discovers_pools_through_labelled_services_and_may_only_read_endpointslices() -> None:
    objs = objects(str(MULTIPOOL))
    gw = one(objs, "Deployment", f"{RELEASE}-lathe-gateway")
    assert gw["spec"]["replicas"] >= 2
    args = gw["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--discovery=kubernetes" in args and "--discovery-namespace=lathe" in args
    for pool in ("llama-8b", "qwen3-32b"):
        for role in ("trainer", "sampler"):
            svc = one(objs, "Service", f"{RELEASE}-lathe-{pool}-{role}")
            assert svc["metadata"]["labels"]["lathe.dev/pool"] == pool
            assert svc["metadata"]["labels"]["lathe.dev/role"] == role
            assert [p for p in svc["spec"]["ports"] if p["name"] == "grpc"]
        trainer = one(objs, "Service", f"{RELEASE}-lathe-{pool}-trainer")
        assert trainer["spec"]["selector"]["apps.kubernetes.io/pod-index"] == "0"  # rank 0 serves the pool
    # no other Service carries a role, so no other EndpointSlice looks like a pool's
    roles = [o["metadata"]["name"] for o in objs if o["kind"] == "Service" and "lathe.dev/role" in
             o["metadata"]["labels"]]
    assert len(roles) == 4
    (rule,) = one(objs, "Role", f"{RELEASE}-lathe-gateway-discovery")["rules"]
    assert rule == {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
                    "verbs": ["get", "list", "watch"]}


def test_only_the_gateway_is_open_and_only_checkpoints_reaches_the_store() -> None:
    objs = objects()
    policies = {o["metadata"]["name"].removeprefix(f"{RELEASE}-lathe-"): o["spec"] for o in objs
                if o["kind"] == "NetworkPolicy"}
    assert set(policies) == {"gateway", "checkpoints", "sampler", "smollm2-trainer", "postgres", "minio"}

    def callers(spec: dict) -> set[str]:
        return {peer["podSelector"]["matchLabels"]["app.kubernetes.io/component"]
                for rule in spec["ingress"] for peer in rule.get("from", [])}

    open_ports = {name: {p["port"] for rule in spec["ingress"] if "from" not in rule for p in rule["ports"]}
                  for name, spec in policies.items()}
    assert open_ports["gateway"] == {"grpc", "http"}
    assert all(ports <= {"metrics"} for name, ports in open_ports.items() if name != "gateway")
    # the gateway's metrics (usage by tenant) only from the monitoring namespace
    assert [(rule["from"], rule["ports"]) for rule in policies["gateway"]["ingress"] if "from" in rule] == [
        ([{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}],
         [{"port": "metrics"}])]
    assert callers(policies["minio"]) == {"checkpoints"}
    assert callers(policies["postgres"]) == {"gateway"}
    assert callers(policies["checkpoints"]) == {"gateway", "trainer", "sampler"}
    assert callers(policies["sampler"]) == {"gateway"}
    assert callers(policies["smollm2-trainer"]) == {"gateway", "trainer"}  # the pool's own ranks, for NCCL
    release = {"podSelector": {"matchLabels": {"app.kubernetes.io/name": "lathe",
                                               "app.kubernetes.io/instance": RELEASE}}}
    for name in ("sampler", "smollm2-trainer"):  # no way out of the release but DNS: no external store either
        assert "Egress" in policies[name]["policyTypes"]
        assert [peer for rule in policies[name]["egress"] for peer in rule.get("to", [])] == [release]


@VALUES
def test_every_lathe_pod_runs_as_non_root_on_a_read_only_root_filesystem(values: str) -> None:
    workloads = [o for o in objects(values) if o["kind"] in ("Deployment", "StatefulSet")]
    assert len(workloads) >= 6
    for w in workloads:
        pod = w["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] > 0, w
        for c in pod["containers"] + pod.get("initContainers", []):
            sc = c["securityContext"]
            assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False, c["name"]
            assert sc["capabilities"]["drop"] == ["ALL"]


def test_an_sglang_pool_runs_sglang_beside_the_sampler_on_the_gpu_and_shares_the_adapters(tmp_path: Path) -> None:
    pod = one(objects(str(SGLANG)), "Deployment", f"{RELEASE}-lathe-smollm2-sglang-sampler")["spec"]["template"]["spec"]
    sampler, sglang = pod["containers"]
    assert (sampler["name"], sglang["name"]) == ("sampler", "sglang")
    assert {"--engine=sglang", "--sglang-url=http://127.0.0.1:30000", "--sglang-adapter-dir=/adapters",
            "--adapter-cache=16"} <= set(sampler["args"])
    assert sglang["command"] == ["python3", "-m", "sglang.launch_server"]
    assert {"--model-path=/models/SmolLM2-135M-Instruct", "--host=127.0.0.1", "--port=30000", "--enable-lora",
            "--enable-deterministic-inference", "--max-loaded-loras=16"} <= set(sglang["args"])
    assert env_of(sglang)["SGLANG_RETURN_ORIGINAL_LOGPROB"] == "1"
    at = sglang["args"].index("--lora-target-modules")
    assert sglang["args"][at + 1:at + 9] == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                             "down_proj", "lm_head"]  # every target a Lathe adapter may have
    # the GPU is SGLang's; the sampler container runs the CPU image
    assert sglang["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert "nvidia.com/gpu" not in sampler["resources"]["limits"]
    assert not sampler["image"].endswith("-cuda:0.1.0")
    # readiness: the sampler's gRPC health stays NOT_SERVING until SGLang answers; SGLang's own probes ask /health
    assert sampler["readinessProbe"]["grpc"] == {"port": 8520}
    assert "127.0.0.1:30000/health" in sglang["readinessProbe"]["exec"]["command"][-1]
    mounts = {c["name"]: {m["name"]: m for m in c["volumeMounts"]} for c in (sampler, sglang)}
    assert mounts["sampler"]["adapters"]["mountPath"] == mounts["sglang"]["adapters"]["mountPath"] == "/adapters"
    assert mounts["sglang"]["adapters"]["readOnly"] is True
    assert {"name": "adapters", "emptyDir": {}} in pod["volumes"]
    # the default pool keeps the native engine: one container
    native_pod = one(objects(), "Deployment", f"{RELEASE}-lathe-smollm2-sampler")["spec"]["template"]["spec"]
    (native,) = native_pod["containers"]
    assert not any(a.startswith("--engine") for a in native["args"])
    values = tmp_path / "values.yaml"
    values.write_text("poolDefaults:\n  sampler:\n    engine: sglang\n")
    out = subprocess.run([helm(), "template", RELEASE, str(CHART), "-f", str(values)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode != 0 and "sampler.sglang.modelPath" in out.stderr


def test_disruption_budgets_cover_every_lathe_component() -> None:
    objs = objects(str(MULTIPOOL))
    pdbs = {o["metadata"]["name"]: o["spec"] for o in objs if o["kind"] == "PodDisruptionBudget"}
    expected = {"gateway", "checkpoints"} | {f"{p}-{r}" for p in ("llama-8b", "qwen3-32b")
                                             for r in ("trainer", "sampler")}
    assert set(pdbs) == {f"{RELEASE}-lathe-{n}" for n in expected}
    assert pdbs[f"{RELEASE}-lathe-gateway"]["minAvailable"] == 1
    sts = one(objs, "StatefulSet", f"{RELEASE}-lathe-qwen3-32b-trainer")
    assert pdbs[f"{RELEASE}-lathe-qwen3-32b-trainer"]["selector"] == sts["spec"]["selector"]


def test_services_probe_grpc_health_and_are_scraped() -> None:
    objs = objects()
    for kind, name in (("Deployment", "gateway"), ("Deployment", "checkpoints"),
                       ("StatefulSet", "smollm2-trainer"), ("Deployment", "smollm2-sampler")):
        w = one(objs, kind, f"{RELEASE}-lathe-{name}")
        (c,) = w["spec"]["template"]["spec"]["containers"]
        grpc_port = next(p["containerPort"] for p in c["ports"] if p["name"] == "grpc")
        metrics_port = next(p["containerPort"] for p in c["ports"] if p["name"] == "metrics")
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert c[probe]["grpc"] == {"port": grpc_port}, (name, probe)
        assert f"--metrics-port={metrics_port}" in c["args"]
        annotations = w["spec"]["template"]["metadata"]["annotations"]
        assert annotations["prometheus.io/scrape"] == "true"
        assert annotations["prometheus.io/port"] == str(metrics_port)


def test_the_gateway_metrics_port_is_cluster_internal_and_names_no_tenant_by_default(tmp_path: Path) -> None:
    objs = objects()
    doors = one(objs, "Service", f"{RELEASE}-lathe-gateway")
    assert {p["name"] for p in doors["spec"]["ports"]} == {"grpc", "http"}
    assert "lathe.dev/scrape" not in doors["metadata"]["labels"]
    metrics = one(objs, "Service", f"{RELEASE}-lathe-gateway-metrics")
    assert metrics["spec"]["type"] == "ClusterIP" and metrics["metadata"]["labels"]["lathe.dev/scrape"] == "true"
    assert [(p["name"], p["port"]) for p in metrics["spec"]["ports"]] == [("metrics", 9090)]

    def tenant_labels(values: str) -> list[str]:
        w = one(objects(values), "Deployment", f"{RELEASE}-lathe-gateway")
        return [a for a in w["spec"]["template"]["spec"]["containers"][0]["args"] if "tenant-labels" in a]

    assert tenant_labels("") == ["--metrics-tenant-labels=0"]
    on = tmp_path / "tenants.yaml"
    on.write_text("gateway:\n  metricsTenantLabels: 50\n")
    assert tenant_labels(str(on)) == ["--metrics-tenant-labels=50"]


def test_download_urls_point_where_clients_reach_the_doors_and_the_store(tmp_path: Path) -> None:
    """The in-release MinIO answers only the checkpoints service, so it presigns no URL unless told where clients
    reach it; the gateway signs its own for the Ingress's host; an external store presigns for its own endpoint."""

    def render_with(name: str, text: str) -> tuple[list[str], object]:
        values = tmp_path / name
        values.write_text(text)
        objs = objects(str(values))
        gw = one(objs, "Deployment", f"{RELEASE}-lathe-gateway")["spec"]["template"]["spec"]["containers"][0]
        ck = one(objs, "Deployment", f"{RELEASE}-lathe-checkpoints")["spec"]["template"]["spec"]["containers"][0]
        return [a for a in gw["args"] if a.startswith("--http-public-url")], env_of(ck).get("LATHE_S3_PUBLIC_ENDPOINT")

    assert render_with("default.yaml", "{}\n") == ([], "none")
    assert render_with("ingress.yaml", "gateway:\n  ingress:\n    enabled: true\n    host: l.example.com\n"
                       "    tlsSecret: l-tls\n") == (["--http-public-url=https://l.example.com"], "none")
    assert render_with("plain.yaml", "gateway:\n  ingress:\n    enabled: true\n    host: l.example.com\n"
                       "store:\n  minio:\n    publicEndpoint: https://s3.example.com\n") == (
        ["--http-public-url=http://l.example.com"], "https://s3.example.com")
    external = ("gateway:\n  publicUrl: https://door.example.com/lathe\nstore:\n  minio:\n    enabled: false\n"
                "  external:\n    endpoint: https://s3.amazonaws.com\n    credentialsSecret: s3\n")
    assert render_with("external.yaml", external) == (["--http-public-url=https://door.example.com/lathe"], None)


def test_the_generated_api_key_has_the_tinker_form_the_http_door_takes() -> None:
    secret = one(objects(), "Secret", f"{RELEASE}-lathe-api-keys")
    line = base64.b64decode(secret["data"]["api-keys"]).decode()
    assert re.fullmatch(r"tml-[A-Za-z0-9]{40}=default\n", line), line
    keys = ApiKeys.parse(line)
    assert keys.tinker_tenant(line.partition("=")[0]) == "default"


def test_dashboards_and_alert_rules_ship_as_the_chart_files() -> None:
    objs = objects(str(MULTIPOOL))
    dashboards = {}
    for cm in (o for o in objs if o["kind"] == "ConfigMap" and o["metadata"]["labels"].get("grafana_dashboard")):
        assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
        dashboards.update(cm["data"])
    files = {p.name: p.read_text() for p in (CHART / "dashboards").glob("*.json")}
    assert {"cycles.json", "service.json"} <= set(files)
    assert {k: v.strip() for k, v in dashboards.items()} == {k: v.strip() for k, v in files.items()}
    rule = next(o for o in objs if o["kind"] == "PrometheusRule")
    assert rule["spec"] == yaml.safe_load((CHART / "alerts" / "rules.yaml").read_text())
    monitor = next(o for o in objs if o["kind"] == "ServiceMonitor")
    scraped = [o["metadata"]["name"] for o in objs if o["kind"] == "Service"
               and o["metadata"]["labels"].get("lathe.dev/scrape") == "true"]
    assert monitor["spec"]["selector"]["matchLabels"]["lathe.dev/scrape"] == "true"
    assert sorted(scraped) == sorted(f"{RELEASE}-lathe-{n}" for n in (
        "gateway-metrics", "checkpoints", "llama-8b-ranks", "llama-8b-sampler", "qwen3-32b-ranks", "qwen3-32b-sampler"))
    assert not [o for o in objects() if o["kind"] in ("PrometheusRule", "ServiceMonitor")]  # CRDs: opt-in


def test_secrets_reach_containers_through_the_environment_or_files_never_argv() -> None:
    objs = objects()
    for w in (o for o in objs if o["kind"] in ("Deployment", "StatefulSet")):
        for c in w["spec"]["template"]["spec"]["containers"]:
            assert not [a for a in c.get("args", []) if re.search(r"token=|password|secret|://\w+:", a.lower())]
            if c["image"].split("/")[-1].startswith("lathe-"):
                assert env_of(c)["LATHE_INTERNAL_TOKEN"]["secretKeyRef"]["key"] == "token"
    gateway = env_of(one(objs, "Deployment", f"{RELEASE}-lathe-gateway")["spec"]["template"]["spec"]["containers"][0])
    assert gateway["LATHE_DB_URL"] == f"postgresql+psycopg://lathe:$(POSTGRES_PASSWORD)@{RELEASE}-lathe-postgres:5432/lathe"
    assert gateway["POSTGRES_PASSWORD"] == {"secretKeyRef": {"name": f"{RELEASE}-lathe-postgres", "key": "password"}}
    ckpt = one(objs, "Deployment", f"{RELEASE}-lathe-checkpoints")["spec"]["template"]["spec"]["containers"][0]
    env = env_of(ckpt)
    assert env["LATHE_S3_ENDPOINT"] == f"http://{RELEASE}-lathe-minio:9000" and "--root=s3://lathe-checkpoints" in \
        ckpt["args"]
    assert env["LATHE_S3_SECRET_KEY"] == {"secretKeyRef": {"name": f"{RELEASE}-lathe-minio", "key": "secret-key"}}


# ---------- the images ----------

TARGETS = ("gateway", "checkpoints", "trainer", "sampler")


def stages() -> dict[str, str]:
    """docker/Dockerfile's stages by name: the text from ``FROM ... AS name`` to the next FROM."""
    text = (REPO / "docker" / "Dockerfile").read_text()
    parts = re.split(r"^FROM\s+", text, flags=re.M)[1:]
    return {re.match(r"\S+\s+AS\s+(\S+)", p, flags=re.I).group(1): p for p in parts}


@pytest.mark.parametrize("target", TARGETS)
def test_each_service_image_is_non_root_installs_its_extra_and_runs_its_module(target: str) -> None:
    stage = stages()[target]
    user = re.search(r"^USER\s+(\d+)", stage, flags=re.M)
    assert user is not None and int(user.group(1)) != 0
    entry = re.search(r'^ENTRYPOINT \["python", "-m", "lathe\.(\w+)"\]', stage, flags=re.M)
    assert entry is not None and entry.group(1) == target
    assert (REPO / "services" / target / "__main__.py").is_file()
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert f"[{target}]" in stage and target in extras
    torch_based = stage.split("\n", 1)[0].split()[0] == "torch"
    assert torch_based == (target in ("trainer", "sampler"))  # gateway and checkpoints stay slim


def test_the_torch_stage_takes_cpu_or_cuda_wheels_and_the_context_leaves_out_local_state() -> None:
    torch = stages()["torch"]
    assert "ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu" in torch and '"torch==2.13.0"' in torch
    assert "whl/cu128" in (REPO / "docker" / "Dockerfile").read_text()  # the documented CUDA build
    ignored = (REPO / ".dockerignore").read_text().split()
    assert {".venv", ".cache", ".git", "sdk/v1/*_pb2*.py"} <= set(ignored)
