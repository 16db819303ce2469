"""deploy/k8s: every manifest validates against the Kubernetes API models, and the DaemonSet
agrees with the agent itself (its flag parser, its defaults, its probe services) and with the
other manifests (ports, Secret and ConfigMap names and keys, etcd member names)."""

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
