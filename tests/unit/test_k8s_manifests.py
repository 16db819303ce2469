"""deploy/k8s: every manifest validates against the Kubernetes API models, and the DaemonSet
agrees with the agent itself (its flag parser, its defaults, its probe services) and with the
other manifests (ports, Secret and ConfigMap names and keys, etcd member names). What keeps the
deployment alive through its own operations, as `kubectl kustomize` renders it: requests on
every container, etcd's disruption budget, the namespace's Pod Security level against what each
pod needs, the PrometheusRule against deploy/prometheus, the image tag `make image` gives, and
the node-watch container's wiring and permissions."""

from __future__ import annotations

import copy
import functools
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from daemon.api.probes import LIVENESS, READINESS
from daemon.cli import ultrad
from tests.pki import make_ca

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "deploy" / "k8s"
KUSTOMIZATIONS = (K8S, K8S / "monitoring")
SCRAPE_CONFIG = K8S / "prometheus" / "scrape-config.yml"
DOCS = REPO / "docs" / "kubernetes.md"
# Values the kubelet would substitute for $(VAR) in args (from the downward API).
DOWNWARD = {"NODE_NAME": "gpu-node-1", "POD_IP": "192.0.2.10", "POD_NAMESPACE": "ultrascale"}
# etcd client-certificate Secrets the agents mount, and the CN (= etcd user) of each.
ETCD_CLIENT_CNS = {"ultrad-etcd-client": "ultrascale-agent"}
CLUSTER_SCOPED = ("Namespace", "ClusterRole", "ClusterRoleBinding")

models = pytest.importorskip("kubernetes.client.models",
                             reason="the `kubernetes` package (dev extras) is not installed")


class ManifestError(AssertionError):
    pass


def validate(doc: dict[str, Any], where: str) -> Any:
    """The document as its Kubernetes API model; unknown or misspelt fields, missing required
    ones and wrong types raise, naming the field."""
    from pydantic import ValidationError

    group, _, version = doc.get("apiVersion", "").rpartition("/")
    kind = doc.get("kind", "")
    model = getattr(models, f"{version.capitalize()}{kind}", None)
    if model is None or group not in ("", "apps", "batch", "policy", "networking.k8s.io",
                                      "rbac.authorization.k8s.io"):
        raise ManifestError(f"{where}: no Kubernetes model for {doc.get('apiVersion')}/{kind}")
    try:
        obj = model.model_validate(doc)
    except ValidationError as exc:
        raise ManifestError(f"{where}: {exc}") from None
    # The models also accept python_case names, which the API server refuses: the round trip
    # through the JSON names must give back exactly what was written.
    if obj.model_dump(by_alias=True, exclude_unset=True, mode="json") != doc:
        raise ManifestError(f"{where}: a field is not spelt as the API's JSON name")
    return obj


def kustomization(directory: Path) -> dict[str, Any]:
    return yaml.safe_load((directory / "kustomization.yaml").read_text())


def documents(directory: Path) -> dict[str, list[dict[str, Any]]]:
    return {p.name: [d for d in yaml.safe_load_all(p.read_text()) if d]
            for p in sorted(directory.glob("*.yaml")) if p.name != "kustomization.yaml"}


def objects() -> dict[tuple[str, str], dict[str, Any]]:
    out = {}
    for directory in KUSTOMIZATIONS:
        for docs in documents(directory).values():
            for doc in docs:
                out[(doc["kind"], doc["metadata"]["name"])] = doc
    return out


def daemonset() -> dict[str, Any]:
    return objects()[("DaemonSet", "ultrad")]


def container_named(pod: dict[str, Any], name: str) -> dict[str, Any]:
    (container,) = [c for c in pod["containers"] if c["name"] == name]
    return container


def agent_container() -> dict[str, Any]:
    return container_named(daemonset()["spec"]["template"]["spec"], "ultrad")


def expand(arg: str, env: dict[str, str]) -> str:
    return re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], arg)


def port_of(address: str) -> int:
    return int(address.rpartition(":")[2])


# -- schema ------------------------------------------------------------------------------------


def test_every_kubernetes_object_validates_against_its_model() -> None:
    checked = 0
    for directory in KUSTOMIZATIONS:
        for name, docs in documents(directory).items():
            for doc in docs:
                if doc["apiVersion"].startswith("monitoring.coreos.com/"):
                    continue  # a CRD: checked structurally below
                validate(doc, f"{directory.name}/{name}")
                checked += 1
    assert checked >= 7


@pytest.mark.parametrize("mutate, field", [
    (lambda d: d["spec"]["template"]["spec"]["containers"][0]["ports"][0]
     .update(containerport=d["spec"]["template"]["spec"]["containers"][0]["ports"][0]
             .pop("containerPort")), "containerport"),
    (lambda d: d["spec"]["template"]["spec"].update(
        terminationGracePeriodSecond=d["spec"]["template"]["spec"]
        .pop("terminationGracePeriodSeconds")), "terminationGracePeriodSecond"),
    (lambda d: d["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["grpc"]
     .update(port="7401"), "port"),
    (lambda d: d["spec"]["template"]["spec"].pop("containers"), "containers"),
    (lambda d: d["spec"]["template"]["spec"].update(
        host_network=d["spec"]["template"]["spec"].pop("hostNetwork")), "spelt"),
])
def test_a_mutated_manifest_is_refused_naming_the_field(mutate: Any, field: str) -> None:
    doc = copy.deepcopy(daemonset())
    validate(copy.deepcopy(doc), "original")
    mutate(doc)
    with pytest.raises(ManifestError, match=field):
        validate(doc, "mutated")


def test_the_servicemonitor_selects_the_ultrad_service_metrics_port() -> None:
    objs = objects()
    monitor = objs[("ServiceMonitor", "ultrad")]
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert set(monitor) == {"apiVersion", "kind", "metadata", "spec"}
    spec = monitor["spec"]
    assert set(spec) <= {"selector", "endpoints", "namespaceSelector", "jobLabel"}
    service = objs[("Service", "ultrad")]
    labels = service["metadata"]["labels"]
    assert spec["selector"]["matchLabels"].items() <= labels.items()
    endpoint_keys = {"port", "path", "interval", "scrapeTimeout", "scheme", "relabelings",
                     "metricRelabelings", "honorLabels"}
    service_ports = {p["name"] for p in service["spec"]["ports"]}
    for endpoint in spec["endpoints"]:
        assert set(endpoint) <= endpoint_keys, set(endpoint) - endpoint_keys
        assert endpoint["port"] in service_ports
        assert endpoint["path"] == "/metrics"
        for rule in endpoint.get("relabelings", ()):
            assert set(rule) <= {"sourceLabels", "targetLabel", "regex", "action",
                                 "replacement", "separator"}


def test_the_plain_scrape_config_keeps_the_ultrad_metrics_endpoints() -> None:
    config = yaml.safe_load(SCRAPE_CONFIG.read_text())
    (job,) = config["scrape_configs"]
    (sd,) = job["kubernetes_sd_configs"]
    assert sd["role"] == "endpoints"
    assert sd["namespaces"]["names"] == [kustomization(K8S)["namespace"]]
    keep = [r for r in job["relabel_configs"] if r.get("action") == "keep"]
    service = objects()[("Service", "ultrad")]
    metrics_port = next(p for p in service["spec"]["ports"] if p["name"] == "metrics")
    assert keep and keep[0]["regex"] == f"{service['metadata']['name']};{metrics_port['name']}"
    assert job["metrics_path"] == "/metrics"


def test_every_object_carries_the_recommended_labels() -> None:
    for (kind, name), doc in objects().items():
        labels = doc["metadata"].get("labels", {})
        assert labels.get("app.kubernetes.io/part-of") == "ultrascale", (kind, name)
        assert "app.kubernetes.io/name" in labels, (kind, name)
        template = doc.get("spec", {}).get("template")
        if template is not None:
            pod_labels = template["metadata"]["labels"]
            if kind != "Job":  # a Job's selector is generated
                assert doc["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
            assert pod_labels.get("app.kubernetes.io/part-of") == "ultrascale", (kind, name)


# -- kustomize ---------------------------------------------------------------------------------


@pytest.mark.parametrize("directory", KUSTOMIZATIONS, ids=lambda d: d.name)
def test_the_kustomization_lists_exactly_the_manifests(directory: Path) -> None:
    listed = kustomization(directory)["resources"]
    assert len(listed) == len(set(listed))
    missing = [r for r in listed if not (directory / r).is_file()
               and not (directory / r / "kustomization.yaml").is_file()]
    assert not missing, f"listed but absent: {missing}"
    unlisted = set(documents(directory)) - set(listed)
    assert not unlisted, f"{directory.relative_to(REPO)}: not in kustomization.yaml: {unlisted}"


def test_kubectl_kustomize_builds_every_object_into_the_namespace() -> None:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed (CI installs it: .ci/run)")
    for directory in KUSTOMIZATIONS:
        built = subprocess.run([kubectl, "kustomize", str(directory)], capture_output=True,
                               text=True, timeout=120, check=True).stdout
        docs = [d for d in yaml.safe_load_all(built) if d]
        files = {(d["kind"], d["metadata"]["name"])
                 for ds in documents(directory).values() for d in ds}
        generated = {("ConfigMap", g["name"])
                     for r in kustomization(directory)["resources"]
                     if (directory / r / "kustomization.yaml").is_file()
                     for g in kustomization(directory / r).get("configMapGenerator", ())}
        # Generated ConfigMaps carry a hash of their content after their name.
        names = {(d["kind"], re.sub(r"-[a-z0-9]{10}$", "", d["metadata"]["name"])
                  if d["kind"] == "ConfigMap" else d["metadata"]["name"]) for d in docs}
        assert names == files | generated
        namespace = kustomization(directory)["namespace"]
        for doc in docs:
            if doc["kind"] not in CLUSTER_SCOPED:
                assert doc["metadata"]["namespace"] == namespace, doc["metadata"]["name"]
            for subject in doc.get("subjects", ()):
                # A binding to a service account of another namespace grants nothing here.
                assert subject["namespace"] == namespace, doc["metadata"]["name"]


# -- the DaemonSet against the agent ------------------------------------------------------------


def secret_data(name: str, pki: Path) -> dict[str, bytes]:
    """What the Secret `name` holds once created as docs/kubernetes.md says."""
    if name == "ultrad-token":
        return {"token": b"k8s-test-token\n"}
    if name == "ultrad-tls":
        ca = make_ca(pki, "cluster")
        agent = ca.issue("agent", san=f"IP:{DOWNWARD['POD_IP']}")
        return {"tls.crt": agent.cert.read_bytes(), "tls.key": agent.key.read_bytes(),
                "ca.crt": ca.cert.read_bytes()}
    if name in ETCD_CLIENT_CNS:
        # deploy/etcd/make-certs.sh writes one directory per Secret, its files the keys
        # (tests/integration/test_etcd_rbac.py runs it); the same shape, made quicker.
        ca = make_ca(pki / "etcd", "etcd")
        client = ca.issue(ETCD_CLIENT_CNS[name])
        return {"tls.crt": client.cert.read_bytes(), "tls.key": client.key.read_bytes(),
                "ca.crt": ca.cert.read_bytes()}
    raise AssertionError(f"the DaemonSet mounts Secret {name!r}, which docs/kubernetes.md "
                         "does not say how to create")


def agent_args(tmp_path: Path) -> list[str]:
    """The container's args as the kubelet runs them, with every mounted file the agent reads
    written under tmp_path (the job from the ConfigMap itself)."""
    container = agent_container()
    env = {e["name"] for e in container["env"]}
    assert env == set(DOWNWARD), "every $(VAR) needs a definition"
    args = [expand(a, DOWNWARD) for a in container["args"]]
    objs = objects()
    spec = daemonset()["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    for mount in container["volumeMounts"]:
        volume = volumes[mount["name"]]
        root = tmp_path / mount["mountPath"].lstrip("/")
        if "configMap" in volume:
            root.mkdir(parents=True)
            for key, text in objs[("ConfigMap", volume["configMap"]["name"])]["data"].items():
                (root / key).write_text(text)
        elif "secret" in volume:
            # The Secrets are made by the operator (docs/kubernetes.md): their keys as the
            # documented commands create them, their files with the volume's defaultMode.
            secret = volume["secret"]
            root.mkdir(parents=True)
            for key, data in secret_data(secret["secretName"], tmp_path / "pki").items():
                (root / key).write_bytes(data)
                (root / key).chmod(secret.get("defaultMode", 0o644))
    return [a.replace("=/etc/", f"={tmp_path}/etc/") for a in args]


def parsed_options(tmp_path: Path) -> dict[str, Any]:
    args = agent_args(tmp_path)
    parser = ultrad._parser()
    known = {s for action in parser._actions for s in action.option_strings}
    unknown = [a for a in args if a.split("=", 1)[0] not in known]
    assert not unknown, f"flags ultrad does not have (argparse would take a prefix): {unknown}"
    return ultrad.resolve_options(parser.parse_args(args), {})


def test_the_agent_accepts_the_daemonset_command_line(tmp_path: Path) -> None:
    assert agent_container()["command"] == ["ultrad"]
    opts = parsed_options(tmp_path)
    config = ultrad.build_config(opts)  # every check the agent makes at start
    assert config.node_id == DOWNWARD["NODE_NAME"]
    assert config.job_file is not None and config.job_file.is_file()
    assert config.tls is not None and config.tls.ca is not None, "mTLS between agents"


def test_ports_and_probes_match_the_agent(tmp_path: Path) -> None:
    opts = parsed_options(tmp_path)
    container = agent_container()
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["grpc"] == port_of(opts["listen"]) == port_of(ultrad._OPTIONS["listen"][1])
    assert ports["metrics"] == port_of(opts["metrics_listen"]) \
        == port_of(ultrad._OPTIONS["metrics_listen"][1])
    assert ports["health"] == port_of(opts["health_listen"])
    for probe, service in (("readinessProbe", READINESS), ("livenessProbe", LIVENESS)):
        assert container[probe]["grpc"] == {"port": ports["health"], "service": service}
    service = objects()[("Service", "ultrad")]
    for port in service["spec"]["ports"]:
        assert port["targetPort"] in ports and port["port"] == ports[port["targetPort"]]
    assert service["spec"]["selector"].items() \
        <= daemonset()["spec"]["template"]["metadata"]["labels"].items()


def test_peers_get_a_routable_address(tmp_path: Path) -> None:
    spec = daemonset()["spec"]["template"]["spec"]
    assert spec["hostNetwork"] is True and spec["dnsPolicy"] == "ClusterFirstWithHostNet"
    env = {e["name"]: e for e in agent_container()["env"]}
    advertise = next(a for a in agent_container()["args"] if a.startswith("--advertise-host="))
    variable = re.fullmatch(r"--advertise-host=\$\((\w+)\)", advertise)
    assert variable, advertise
    assert env[variable.group(1)]["valueFrom"]["fieldRef"]["fieldPath"] in (
        "status.podIP", "status.hostIP")
    assert parsed_options(tmp_path)["advertise_host"] not in ("", "0.0.0.0", "::")


def test_secrets_configmap_and_volumes_match_the_flags(tmp_path: Path) -> None:
    opts = parsed_options(tmp_path)
    container = agent_container()
    spec = daemonset()["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    raw = {a.split("=", 1)[0]: a.split("=", 1)[1] for a in container["args"]}

    def source(flag: str) -> tuple[dict[str, Any], str]:
        path = Path(raw[flag])
        return volumes[mounts[str(path.parent)]], path.name

    token, key = source("--token-file")
    assert token["secret"]["secretName"] == "ultrad-token" and key == "token"
    assert token["secret"]["defaultMode"] & 0o077 == 0, "ultrad refuses a readable token file"
    for flag, key in (("--tls-cert", "tls.crt"), ("--tls-key", "tls.key"),
                      ("--tls-ca", "ca.crt")):
        tls, name = source(flag)
        assert tls["secret"]["secretName"] == "ultrad-tls" and name == key
    for flag, key in (("--etcd-cert", "tls.crt"), ("--etcd-key", "tls.key"),
                      ("--etcd-ca", "ca.crt")):
        tls, name = source(flag)
        assert tls["secret"]["secretName"] == "ultrad-etcd-client" and name == key
    job, key = source("--job-file")
    configmap = objects()[("ConfigMap", job["configMap"]["name"])]
    assert key in configmap["data"]
    claim = volumes["checkpoints"]["persistentVolumeClaim"]["claimName"]
    pvc = objects()[("PersistentVolumeClaim", claim)]
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    assert mounts["/var/lib/ultrad"] == "state" and opts["state_dir"] == "/var/lib/ultrad"
    # The secrets the docs tell operators to create are the ones mounted, with these keys.
    docs = DOCS.read_text()
    assert "kubectl -n ultrascale create secret generic ultrad-token --from-file=token=" in docs
    assert re.search(r"create secret generic ultrad-tls\s+\\?\s*--from-file=tls\.crt=.*"
                     r"--from-file=tls\.key=.*--from-file=ca\.crt=", docs, re.S)
    # etcd's Secrets: one directory of deploy/etcd/make-certs.sh's output each.
    for secret in ("etcd-server-tls", "etcd-peer-tls", "etcd-root-client", "ultrad-etcd-client"):
        assert secret in docs and secret in (REPO / "deploy/etcd/make-certs.sh").read_text()
    assert "create secret generic \"$s\" --from-file=" in docs


def test_devices_match_the_gpu_request_and_the_grace_period_allows_a_drain(
        tmp_path: Path) -> None:
    opts = parsed_options(tmp_path)
    container = agent_container()
    assert container["resources"]["limits"]["nvidia.com/gpu"] == str(opts["devices"])
    spec = daemonset()["spec"]["template"]["spec"]
    assert any(t["key"] == "nvidia.com/gpu" for t in spec["tolerations"])
    assert spec["nodeSelector"]
    # A drain finishes a step and writes a durable checkpoint; a few lease TTLs are not
    # enough for either on real models.
    assert spec["terminationGracePeriodSeconds"] >= max(120, 10 * opts["ttl"])


def test_the_agents_dial_every_etcd_member_by_its_stable_name(tmp_path: Path) -> None:
    objs = objects()
    sts = objs[("StatefulSet", "etcd")]
    service = objs[("Service", sts["spec"]["serviceName"])]
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"]
    replicas = sts["spec"]["replicas"]
    assert replicas == 3
    (claim,) = sts["spec"]["volumeClaimTemplates"]
    (etcd,) = sts["spec"]["template"]["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in etcd["ports"]}
    env = {e["name"] for e in etcd["env"]}
    assert {v for a in etcd["args"] for v in re.findall(r"\$\((\w+)\)", a)} <= env
    args = dict(a.split("=", 1) for a in etcd["args"])
    ns, svc = "$(POD_NAMESPACE)", service["metadata"]["name"]
    members = [f"{sts['metadata']['name']}-{i}" for i in range(replicas)]
    assert args["--initial-cluster"] == ",".join(
        f"{m}=https://{m}.{svc}.{ns}.svc:{ports['peer']}" for m in members)
    assert args["--initial-advertise-peer-urls"] \
        == f"https://$(POD_NAME).{svc}.{ns}.svc:{ports['peer']}"
    assert args["--data-dir"].startswith(
        next(m["mountPath"] for m in etcd["volumeMounts"]
             if m["name"] == claim["metadata"]["name"]))
    opts = parsed_options(tmp_path)
    assert opts["etcd"].split(",") == [
        f"https://{m}.{svc}.{DOWNWARD['POD_NAMESPACE']}.svc:{ports['client']}" for m in members]


# -- etcd locked down, as `kubectl kustomize deploy/k8s` renders it ------------------------------
#
# What is applied is the kustomize output (namespace set, generated names resolved), so these
# checks read that rather than the files.



@functools.cache
def _kustomize(directory: Path) -> str:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed (CI installs it: .ci/run)")
    return subprocess.run([kubectl, "kustomize", str(directory)], capture_output=True,
                          text=True, timeout=120, check=True).stdout


def built(directory: Path = K8S) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(_kustomize(directory)) if d]


def built_object(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"the kustomize output has no single {kind}/{name}"
    return found[0]


def flag_values(args: list[str]) -> dict[str, str]:
    """`--flag=value` args as a dict; a bare `--flag` is "true" (etcd's boolean flags)."""
    out = {}
    for arg in args:
        name, sep, value = arg.partition("=")
        assert name not in out, f"{name} given twice"
        out[name] = value if sep else "true"
    return out


def mounted_file(pod: dict[str, Any], container: dict[str, Any], path: str
                 ) -> tuple[dict[str, Any], str]:
    """The volume that provides `path` in `container`, and the key (file name) within it."""
    volumes = {v["name"]: v for v in pod["volumes"]}
    for mount in container.get("volumeMounts", ()):
        if Path(path).parent == Path(mount["mountPath"]):
            return volumes[mount["name"]], Path(path).name
    raise AssertionError(f"{path} is on no volume of container {container['name']}")


def urls(value: str) -> list[str]:
    return [u.split("=", 1)[-1] for u in value.split(",")]


def test_kustomized_etcd_serves_clients_and_peers_over_mutual_tls() -> None:
    docs = built()
    sts = built_object(docs, "StatefulSet", "etcd")
    pod = sts["spec"]["template"]["spec"]
    (etcd,) = pod["containers"]
    args = flag_values(etcd["args"])
    for flag in ("--listen-client-urls", "--advertise-client-urls", "--listen-peer-urls",
                 "--initial-advertise-peer-urls", "--initial-cluster"):
        assert all(u.startswith("https://") for u in urls(args[flag])), (flag, args[flag])
    # Both listeners require a certificate signed by their CA (etcd's boolean flags).
    assert args.get("--client-cert-auth") == "true", "clients need a certificate"
    assert args.get("--peer-client-cert-auth") == "true", "peers need a certificate"
    for flag in ("--auto-tls", "--peer-auto-tls"):
        assert args.get(flag, "false") == "false", f"{flag}: self-signed, nobody verified"
    # The JSON gateway would forward requests under the server certificate's own name.
    assert args.get("--enable-grpc-gateway") == "false"
    secrets = {}
    for flag in ("--cert-file", "--key-file", "--trusted-ca-file", "--peer-cert-file",
                 "--peer-key-file", "--peer-trusted-ca-file"):
        volume, key = mounted_file(pod, etcd, args[flag])
        assert "secret" in volume, f"{flag} comes from a Secret"
        assert key in ("tls.crt", "tls.key", "ca.crt"), (flag, key)
        assert volume["secret"]["defaultMode"] & 0o077 == 0, f"{flag}: only etcd reads it"
        secrets[flag] = volume["secret"]["secretName"]
    # Peers are a CA of their own: a client certificate never makes a member.
    assert secrets["--trusted-ca-file"] != secrets["--peer-trusted-ca-file"]
    assert secrets["--cert-file"] == secrets["--key-file"] == secrets["--trusted-ca-file"]
    assert secrets["--peer-cert-file"] == secrets["--peer-key-file"] \
        == secrets["--peer-trusted-ca-file"]


def test_kustomized_agents_dial_etcd_over_https_with_the_agent_client_certificate() -> None:
    docs = built()
    ds = built_object(docs, "DaemonSet", "ultrad")
    pod = ds["spec"]["template"]["spec"]
    container = container_named(pod, "ultrad")
    args = flag_values(container["args"])
    namespace = kustomization(K8S)["namespace"]
    sts = built_object(docs, "StatefulSet", "etcd")
    members = [f"etcd-{i}" for i in range(sts["spec"]["replicas"])]
    env = {**DOWNWARD, "POD_NAMESPACE": namespace}
    assert expand(args["--etcd"], env).split(",") == [
        f"https://{m}.{sts['spec']['serviceName']}.{namespace}.svc:2379" for m in members]
    for flag, key in (("--etcd-ca", "ca.crt"), ("--etcd-cert", "tls.crt"),
                      ("--etcd-key", "tls.key")):
        volume, name = mounted_file(pod, container, args[flag])
        assert name == key and volume["secret"]["secretName"] in ETCD_CLIENT_CNS, flag
        assert volume["secret"]["defaultMode"] & 0o077 == 0, flag
    # etcd names the agents by their certificate (CN ultrascale-agent): no password exists.
    assert "--etcd-user" not in args and "--etcd-password-file" not in args


def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    assert set(selector) <= {"matchLabels"}, f"only matchLabels are checked here: {selector}"
    return selector.get("matchLabels", {}).items() <= labels.items()


def test_kustomized_network_policy_admits_only_ultrad_and_the_bootstrap_to_etcd() -> None:
    docs = built()
    workloads = {(d["kind"], d["metadata"]["name"]): d["spec"]["template"]["metadata"]["labels"]
                 for d in docs if d["kind"] in ("DaemonSet", "StatefulSet", "Job", "Deployment")}
    etcd_labels = workloads[("StatefulSet", "etcd")]
    policies = [d for d in docs if d["kind"] == "NetworkPolicy"
                and _selects(d["spec"]["podSelector"], etcd_labels)]
    assert len(policies) == 1, "one NetworkPolicy selects the etcd pods"
    (policy,) = policies
    validate(policy, "NetworkPolicy")
    assert "Ingress" in policy["spec"]["policyTypes"]
    admitted: dict[int, set[tuple[str, str]]] = {}
    node_blocks: list[str] = []
    for rule in policy["spec"]["ingress"]:
        assert rule.get("ports"), f"a rule without ports opens every port: {rule}"
        assert rule.get("from"), f"a rule without sources admits everyone: {rule}"
        ports = {p["port"] for p in rule["ports"]}
        for source in rule["from"]:
            assert "namespaceSelector" not in source, f"another namespace: {source}"
            if "ipBlock" in source:
                # The GPU nodes' subnet: the agents run with hostNetwork, so most network
                # plugins see their traffic as coming from the node (docs/kubernetes.md).
                assert ports == {2379}, "node addresses reach the client port only"
                assert source["ipBlock"]["cidr"] not in ("0.0.0.0/0", "::/0")
                node_blocks.append(source["ipBlock"]["cidr"])
                continue
            matched = {w for w, labels in workloads.items()
                       if _selects(source["podSelector"], labels)}
            for port in ports:
                admitted.setdefault(port, set()).update(matched)
    assert admitted == {2379: {("DaemonSet", "ultrad"), ("Job", "etcd-rbac")},
                        2380: {("StatefulSet", "etcd")}}, admitted
    assert len(node_blocks) <= 1
    for cidr in node_blocks:
        assert cidr in DOCS.read_text(), f"docs/kubernetes.md says what {cidr} stands for"


def test_kustomized_bootstrap_job_runs_the_rbac_script_as_etcd_root() -> None:
    docs = built()
    job = built_object(docs, "Job", "etcd-rbac")
    validate(job, "Job")
    pod = job["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    script = container["command"][-1]
    volume, key = mounted_file(pod, container, script)
    assert key == "rbac.sh"
    configmap = built_object(docs, "ConfigMap", volume["configMap"]["name"])
    assert configmap["data"]["rbac.sh"] == (REPO / "deploy" / "etcd" / "rbac.sh").read_text()
    for var, name in (("ETCDCTL_CACERT", "ca.crt"), ("ETCDCTL_CERT", "tls.crt"),
                      ("ETCDCTL_KEY", "tls.key")):
        secret, file = mounted_file(pod, container, env[var])
        assert file == name and secret["secret"]["secretName"] == "etcd-root-client", var
    assert all(u.startswith("https://") for u in env["ETCDCTL_ENDPOINTS"].split(","))
    security = container["securityContext"]
    assert security["allowPrivilegeEscalation"] is False
    assert security["capabilities"]["drop"] == ["ALL"]
    assert pod["securityContext"]["runAsNonRoot"] is True


# -- surviving its own operations: QoS, disruption budget, pod security -------------------------


def pod_templates(docs: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(d["kind"], d["metadata"]["name"]): d["spec"]["template"]["spec"]
            for d in docs if d["kind"] in ("DaemonSet", "StatefulSet", "Deployment", "Job")}


def quantity(text: str | int) -> float:
    """A Kubernetes quantity (cpu or bytes) as a number."""
    from kubernetes.utils.quantity import parse_quantity

    return float(parse_quantity(text))


def qos_class(pod: dict[str, Any]) -> str:
    """The QoS class the kubelet gives the pod (cpu and memory only, as it does)."""
    containers = pod["containers"] + pod.get("initContainers", [])
    requests = [c.get("resources", {}).get("requests", {}) for c in containers]
    limits = [c.get("resources", {}).get("limits", {}) for c in containers]
    if not any(r.get(k) or li.get(k) for r, li in zip(requests, limits, strict=True)
               for k in ("cpu", "memory")):
        return "BestEffort"
    # A limit without a request makes the request equal to the limit.
    guaranteed = all(li.get(k) and quantity(r.get(k, li[k])) == quantity(li[k])
                     for r, li in zip(requests, limits, strict=True) for k in ("cpu", "memory"))
    return "Guaranteed" if guaranteed else "Burstable"


def test_every_container_requests_cpu_and_memory() -> None:
    pods = pod_templates(built())
    assert {("DaemonSet", "ultrad"), ("StatefulSet", "etcd"), ("Job", "etcd-rbac")} <= set(pods)
    for workload, pod in pods.items():
        for container in pod["containers"] + pod.get("initContainers", []):
            resources = container.get("resources", {})
            requests, limits = resources.get("requests", {}), resources.get("limits", {})
            where = f"{workload[0]}/{workload[1]} container {container['name']}"
            for key in ("cpu", "memory"):
                assert quantity(requests.get(key, 0)) > 0, f"{where}: no {key} request"
                if key in limits:
                    assert quantity(limits[key]) >= quantity(requests[key]), where
        assert qos_class(pod) != "BestEffort", workload


def test_qos_class_follows_the_kubelets_rules() -> None:
    def pod(**resources: dict[str, str]) -> dict[str, Any]:
        return {"containers": [{"name": "c", "resources": resources}]}

    assert qos_class(pod()) == "BestEffort"
    assert qos_class(pod(limits={"nvidia.com/gpu": "8"})) == "BestEffort"
    assert qos_class(pod(requests={"cpu": "1", "memory": "1Gi"})) == "Burstable"
    assert qos_class(pod(limits={"cpu": "1", "memory": "1Gi"})) == "Guaranteed"
    assert qos_class(pod(requests={"cpu": "1", "memory": "1Gi"},
                         limits={"cpu": "1", "memory": "2Gi"})) == "Burstable"


def test_the_agent_reserves_memory_for_its_shared_memory_volume() -> None:
    ds = built_object(built(), "DaemonSet", "ultrad")
    pod = ds["spec"]["template"]["spec"]
    agent = container_named(pod, "ultrad")
    volumes = {v["name"]: v for v in pod["volumes"]}
    shm = sum(quantity(volumes[m["name"]]["emptyDir"].get("sizeLimit", 0))
              for m in agent["volumeMounts"]
              if volumes[m["name"]].get("emptyDir", {}).get("medium") == "Memory")
    assert shm >= quantity("64Gi"), "collectives and snapshots need a large /dev/shm"
    requests = agent["resources"]["requests"]
    # tmpfs pages are charged to the pod: the request covers /dev/shm full plus the processes
    # (the agent and one worker per device, a few GiB each at the least).
    devices = int(agent["resources"]["limits"]["nvidia.com/gpu"])
    assert quantity(requests["memory"]) >= shm + devices * quantity("4Gi"), requests
    assert quantity(requests["cpu"]) >= devices, "at least a core per worker"
    # A memory limit would have to hold /dev/shm too, and an OOM kill is the failure path:
    # docs/kubernetes.md explains why the agent has none (Burstable).
    assert "memory" not in agent["resources"].get("limits", {})
    assert qos_class(pod) == "Burstable"
    assert "Burstable" in DOCS.read_text()


def test_a_voluntary_disruption_never_takes_etcds_quorum() -> None:
    docs = built()
    sts = built_object(docs, "StatefulSet", "etcd")
    labels = sts["spec"]["template"]["metadata"]["labels"]
    budgets = [d for d in docs if d["kind"] == "PodDisruptionBudget"
               and _selects(d["spec"]["selector"], labels)]
    assert len(budgets) == 1, "one PodDisruptionBudget selects the etcd pods"
    (pdb,) = budgets
    validate(pdb, "PodDisruptionBudget")
    assert pdb["apiVersion"] == "policy/v1"
    assert pdb["spec"] == {"maxUnavailable": 1, "selector": pdb["spec"]["selector"]}
    replicas = sts["spec"]["replicas"]
    assert replicas - pdb["spec"]["maxUnavailable"] >= replicas // 2 + 1, "a quorum stays"
    # It selects etcd's pods and no others.
    others = [w for w, pod_labels in
              ((k, d["spec"]["template"]["metadata"]["labels"]) for k, d in
               (((d["kind"], d["metadata"]["name"]), d) for d in docs
                if d["kind"] in ("DaemonSet", "Job")))
              if _selects(pdb["spec"]["selector"], pod_labels)]
    assert not others, others


# The Pod Security Standards' checks, the parts these pods touch.
LEVELS = ("restricted", "baseline", "privileged")  # strictest first
BASELINE_CAPABILITIES = {"AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL",
                         "MKNOD", "NET_BIND_SERVICE", "SETFCAP", "SETGID", "SETPCAP", "SETUID",
                         "SYS_CHROOT"}
RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral",
                      "persistentVolumeClaim", "projected", "secret"}


def pod_security_violations(pod: dict[str, Any]) -> dict[str, set[str]]:
    """level -> what in the pod that level forbids."""
    out: dict[str, set[str]] = {"baseline": set(), "restricted": set()}
    for key in ("hostNetwork", "hostPID", "hostIPC"):
        if pod.get(key):
            out["baseline"].add(key)
    pod_security = pod.get("securityContext", {})
    volume_types = {k for v in pod.get("volumes", []) for k in v if k != "name"}
    if "hostPath" in volume_types:
        out["baseline"].add("hostPath")
    out["restricted"] |= {f"volume {t}" for t in volume_types - RESTRICTED_VOLUMES}
    for c in pod["containers"] + pod.get("initContainers", []):
        sc = c.get("securityContext", {})
        if sc.get("privileged"):
            out["baseline"].add("privileged")
        if any(p.get("hostPort") for p in c.get("ports", [])):
            out["baseline"].add("hostPort")
        added = set(sc.get("capabilities", {}).get("add", []))
        out["baseline"] |= {f"capability {a}" for a in added - BASELINE_CAPABILITIES}
        out["restricted"] |= {f"capability {a}" for a in added - {"NET_BIND_SERVICE"}}
        if sc.get("allowPrivilegeEscalation") is not False:
            out["restricted"].add(f"{c['name']}: allowPrivilegeEscalation")
        if "ALL" not in sc.get("capabilities", {}).get("drop", []):
            out["restricted"].add(f"{c['name']}: capabilities not dropped")
        if not sc.get("runAsNonRoot", pod_security.get("runAsNonRoot", False)):
            out["restricted"].add(f"{c['name']}: may run as root")
        seccomp = sc.get("seccompProfile", pod_security.get("seccompProfile", {}))
        if seccomp.get("type") not in ("RuntimeDefault", "Localhost"):
            out["restricted"].add(f"{c['name']}: no seccomp profile")
    out["restricted"] |= out["baseline"]
    return out


def pod_security_level(pod: dict[str, Any]) -> str:
    violations = pod_security_violations(pod)
    return next(level for level in LEVELS if not violations.get(level))


def test_the_pod_security_checker_knows_the_levels() -> None:
    restricted = {"securityContext": {"runAsNonRoot": True,
                                      "seccompProfile": {"type": "RuntimeDefault"}},
                  "containers": [{"name": "c", "securityContext": {
                      "allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}}]}
    assert pod_security_level(restricted) == "restricted"
    as_root = copy.deepcopy(restricted)
    as_root["securityContext"]["runAsNonRoot"] = False
    assert pod_security_level(as_root) == "baseline"
    host = copy.deepcopy(restricted)
    host["hostNetwork"] = True
    assert pod_security_level(host) == "privileged"
    ipc_lock = copy.deepcopy(restricted)
    ipc_lock["containers"][0]["securityContext"]["capabilities"]["add"] = ["IPC_LOCK"]
    assert pod_security_level(ipc_lock) == "privileged"


def test_the_namespace_enforces_the_strictest_level_every_pod_meets() -> None:
    docs = built()
    namespace = built_object(docs, "Namespace", kustomization(K8S)["namespace"])
    labels = namespace["metadata"]["labels"]
    levels = {w: pod_security_level(pod) for w, pod in pod_templates(docs).items()}
    strictest_for_all = max(levels.values(), key=LEVELS.index)
    assert labels["pod-security.kubernetes.io/enforce"] == strictest_for_all, levels
    for mode in ("enforce", "audit", "warn"):
        assert labels[f"pod-security.kubernetes.io/{mode}"] in LEVELS, mode
        assert labels[f"pod-security.kubernetes.io/{mode}-version"] == "latest", mode
        assert LEVELS.index(labels[f"pod-security.kubernetes.io/{mode}"]) \
            <= LEVELS.index(labels["pod-security.kubernetes.io/enforce"]), mode
    # Only the agents need more than what audit and warn report on: any other pod that does
    # shows up at apply time.
    reported = {labels["pod-security.kubernetes.io/audit"], labels["pod-security.kubernetes.io/warn"]}
    for workload, level in levels.items():
        if workload != ("DaemonSet", "ultrad"):
            assert all(LEVELS.index(level) <= LEVELS.index(r) for r in reported), (workload, level)
    # What puts the agents at the privileged level, each one explained in the docs.
    agent = pod_templates(docs)[("DaemonSet", "ultrad")]
    assert pod_security_violations(agent)["baseline"] \
        == {"hostNetwork", "hostPath", "capability IPC_LOCK"}
    docs_text = DOCS.read_text()
    for need in ("hostNetwork", "hostPath", "IPC_LOCK"):
        assert need in docs_text.split("Why ultrad needs what it needs", 1)[1], need


# -- monitoring: the PrometheusRule is the rule files --------------------------------------------


def _render_rules() -> Any:
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "render_rules", K8S / "monitoring" / "render_rules.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_prometheusrule_carries_exactly_the_rule_files(tmp_path: Path) -> None:
    committed = (K8S / "monitoring" / "prometheusrule.yaml").read_text()
    assert committed == _render_rules().render(), \
        "deploy/k8s/monitoring/prometheusrule.yaml is stale: run `make k8s-rules`"
    docs = built(K8S / "monitoring")
    rule = built_object(docs, "PrometheusRule", "ultrad")
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert rule["metadata"]["namespace"] == kustomization(K8S / "monitoring")["namespace"]
    assert set(rule["spec"]) == {"groups"}
    files = [g for name in ("recording.rules.yml", "alerts.rules.yml")
             for g in yaml.safe_load((REPO / "deploy" / "prometheus" / name).read_text())["groups"]]
    assert rule["spec"]["groups"] == files
    alerts = [r for g in rule["spec"]["groups"] for r in g["rules"] if "alert" in r]
    assert {"UltraAgentDown", "UltraAllAgentsDown", "UltraAgentsAbsent"} \
        <= {a["alert"] for a in alerts}
    # The groups are valid Prometheus rules as the operator hands them over.
    promtool = shutil.which("promtool")
    if promtool is not None:
        path = tmp_path / "prometheusrule.rules.yml"
        path.write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
        result = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True,
                                text=True, timeout=60)
        assert result.returncode == 0, result.stdout + result.stderr


def test_the_rendered_rules_follow_an_edit_of_the_rule_files(tmp_path: Path) -> None:
    for name in ("recording.rules.yml", "alerts.rules.yml"):
        shutil.copy(REPO / "deploy" / "prometheus" / name, tmp_path / name)
    alerts = yaml.safe_load((tmp_path / "alerts.rules.yml").read_text())
    alerts["groups"][0]["rules"][0]["for"] = "7m"
    (tmp_path / "alerts.rules.yml").write_text(yaml.safe_dump(alerts))
    edited = _render_rules().render(tmp_path)
    assert edited != (K8S / "monitoring" / "prometheusrule.yaml").read_text()
    assert "for: 7m" in edited


# -- the image `make image` builds --------------------------------------------------------------


def test_the_manifests_name_the_image_make_builds() -> None:
    make = shutil.which("make")
    if make is None:
        pytest.skip("make is not installed")
    tag = subprocess.run([make, "-s", "--no-print-directory", "image-tag"], cwd=REPO,
                         capture_output=True, text=True, timeout=60, check=True).stdout.strip()
    version = re.search(r'^version = "([^"]+)"', (REPO / "pyproject.toml").read_text(), re.M)
    assert version and tag == f"ultrascale/ultrad:{version.group(1)}"
    docs = built()
    images = {c["image"] for pod in pod_templates(docs).values() for c in pod["containers"]
              if "ultrad" in c["image"]}
    assert images == {tag}, images
    for containerfile in ("Containerfile", "Containerfile.cpu"):
        text = (REPO / "deploy" / "container" / containerfile).read_text()
        assert containerfile in (REPO / "Makefile").read_text()
        assert re.search(r"^FROM \$\{BASE\}$", text, re.M), containerfile
    assert '"/src[gpu]"' in (REPO / "deploy" / "container" / "Containerfile").read_text()
    torch_cpu = re.search(r"^TORCH_CPU \?= (\S+)$", (REPO / "Makefile").read_text(), re.M)
    assert torch_cpu and f"ARG TORCH={torch_cpu.group(1)}" in \
        (REPO / "deploy" / "container" / "Containerfile.cpu").read_text()


# -- the node-watch container: cordon -> drain ---------------------------------------------------


def test_the_nodewatch_container_reaches_its_agent_and_only_it_reads_nodes(
        tmp_path: Path) -> None:
    from daemon.cli import nodewatch

    docs = built()
    ds = built_object(docs, "DaemonSet", "ultrad")
    pod = ds["spec"]["template"]["spec"]
    agent, watch = container_named(pod, "ultrad"), container_named(pod, "nodewatch")
    assert {c["name"] for c in pod["containers"]} == {"ultrad", "nodewatch"}
    # Its command line parses (unknown flags would exit 2).
    env = {e["name"]: e.get("value", "") for e in watch["env"]}
    args = nodewatch._parser({"KUBERNETES_SERVICE_HOST": "10.0.0.1"}).parse_args(
        [expand(a, DOWNWARD) for a in watch["args"]])
    assert args.node == DOWNWARD["NODE_NAME"]
    assert watch["command"][-1] == "daemon.cli.nodewatch"
    # It dials the agent's gRPC port on the node's address, with the agent's token and TLS.
    ports = {p["name"]: p["containerPort"] for p in agent["ports"]}
    assert expand(env["ULTRA_ENDPOINT"], DOWNWARD) == f"{DOWNWARD['POD_IP']}:{ports['grpc']}"
    agent_args = flag_values(agent["args"])
    assert env["ULTRA_TOKEN_FILE"] == agent_args["--token-file"]
    assert (env["ULTRA_TLS_CA"], env["ULTRA_TLS_CERT"], env["ULTRA_TLS_KEY"]) == (
        agent_args["--tls-ca"], agent_args["--tls-cert"], agent_args["--tls-key"])
    for path in (env["ULTRA_TOKEN_FILE"], env["ULTRA_TLS_CA"], env["ULTRA_TLS_KEY"]):
        volume, _ = mounted_file(pod, watch, path)
        assert volume == mounted_file(pod, agent, path)[0]
    # The service account token reaches the watcher alone: the agent runs no API calls.
    assert pod["automountServiceAccountToken"] is False
    volumes = {v["name"]: v for v in pod["volumes"]}
    token_volumes = {name for name, v in volumes.items()
                     if any("serviceAccountToken" in s for s in v.get("projected", {})
                            .get("sources", ()))}
    assert token_volumes and all(
        m["name"] not in token_volumes for m in agent["volumeMounts"])
    (mount,) = [m for m in watch["volumeMounts"] if m["name"] in token_volumes]
    assert Path(mount["mountPath"]) == nodewatch.SERVICE_ACCOUNT
    assert watch["securityContext"]["capabilities"]["drop"] == ["ALL"]
    assert watch["securityContext"]["allowPrivilegeEscalation"] is False
    # Its service account may get nodes, and nothing else.
    account = pod["serviceAccountName"]
    built_object(docs, "ServiceAccount", account)
    bindings = [d for d in docs if d["kind"] in ("ClusterRoleBinding", "RoleBinding")
                and any(s["kind"] == "ServiceAccount" and s["name"] == account
                        for s in d["subjects"])]
    rules = [r for b in bindings
             for r in built_object(docs, b["roleRef"]["kind"], b["roleRef"]["name"])["rules"]]
    assert rules == [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["get"]}]
    for binding in bindings:
        validate(binding, binding["kind"])
