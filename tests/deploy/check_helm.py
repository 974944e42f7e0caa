#!/usr/bin/env python3
"""Checks of the Helm chart with a real Helm 3 binary.

  check_helm.py --helm PATH lint     helm lint --strict, defaults and every values file
  check_helm.py --helm PATH render   helm template over the matrix of tests/deploy/values,
                                     asserting on the rendered objects
  check_helm.py --helm PATH schema   values.schema.json (and kubeVersion, and the templates'
                                     comparisons) reject bad values
  check_helm.py --helm PATH flags --kvcached BIN
                                     every flag any case renders is one `kvcached --help` lists
"""

import argparse
import copy
import difflib
import json
import pathlib
import re
import subprocess
import sys

import yaml

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import deploylib as dl  # noqa: E402

VALUES_DIR = pathlib.Path(__file__).resolve().parent / "values"
RELEASE, NAMESPACE = "kvc", "kvcache"
FULLNAME = f"{RELEASE}-kvcache-manager"
MONITORING_API = ["--api-versions", "monitoring.coreos.com/v1"]

# (case name, values file, extra helm template arguments, monitoring API served)
CASES = [
    ("default", "default.yaml", [], False),
    ("default on Kubernetes 1.27", "default.yaml", ["--kube-version", "1.27.0"], False),
    ("deployment", "deployment.yaml", [], False),
    ("cuda backend with GPUs", "cuda.yaml", [], False),
    ("cuda backend without a GPU request", "cuda-no-gpu-request.yaml", [], False),
    ("every daemon flag", "all-flags.yaml", [], False),
    ("servicemonitor with the monitoring API", "servicemonitor.yaml", MONITORING_API, True),
    ("servicemonitor without the monitoring API", "servicemonitor.yaml", [], False),
    ("default with the monitoring API", "default.yaml", MONITORING_API, True),
    ("pdb", "pdb.yaml", [], False),
    ("pdb minAvailable", "pdb-min-available.yaml", [], False),
    ("minimal", "minimal.yaml", [], False),
    ("mutual TLS, tokens, state on the node", "tls-tokens-hostpath.yaml", [], False),
    ("TLS with a separate client CA, no state", "tls-client-ca.yaml", [], False),
    ("hand-off over UCX, mTLS, peer Secrets, NetworkPolicy", "handoff.yaml", [], False),
    ("hand-off over gRPC, Deployment, peer CA ConfigMap", "handoff-grpc.yaml", [], False),
    ("hand-off NetworkPolicy without UCX ports", "handoff-networkpolicy.yaml", [], False),
]

# (what, helm arguments, text the error must contain): each must make helm template fail.
REJECTIONS = [
    ("unknown backend", ["--set", "daemon.backend=tpu"], "daemon.backend"),
    ("negative gRPC port", ["--set", "ports.grpc=-1"], "ports.grpc"),
    ("port over 65535", ["--set", "ports.metrics=70000"], "ports.metrics"),
    ("port as a string", ["--set-string", "ports.grpc=50051"], "ports.grpc"),
    ("max_sequences not a number", ["--set", "daemon.maxSequences=many"], "daemon.maxSequences"),
    ("max_sequences zero", ["--set", "daemon.maxSequences=0"], "daemon.maxSequences"),
    ("memory_limit_bytes zero", ["--set", "daemon.memoryLimitBytes=0"], "daemon.memoryLimitBytes"),
    ("pool_memory_bytes negative", ["--set", "daemon.poolMemoryBytes=-5"], "daemon.poolMemoryBytes"),
    ("tp_ranks zero", ["--set", "daemon.tpRanks=0"], "daemon.tpRanks"),
    ("unknown kv dtype", ["--set", "daemon.kvDtype=int8"], "daemon.kvDtype"),
    ("idle_timeout without a unit", ["--set", "daemon.idleTimeout=300"], "daemon.idleTimeout"),
    ("idle_timeout not a duration", ["--set-string", "daemon.idleTimeout=five minutes"], "daemon.idleTimeout"),
    ("keepalive_time not a duration", ["--set-string", "daemon.keepaliveTime=1x"], "daemon.keepaliveTime"),
    ("extra arg not a flag", ["--set", "daemon.extraArgs[0]=oops"], "daemon.extraArgs"),
    ("unknown workload kind", ["--set", "workload.kind=StatefulSet"], "workload.kind"),
    ("negative replicas", ["--set", "workload.replicas=-1"], "workload.replicas"),
    ("unknown top-level key", ["--set", "backend=cuda"], "backend"),
    ("unknown daemon key", ["--set", "daemon.maxSequence=10"], "maxSequence"),
    ("boolean as a string", ["--set", "serviceMonitor.enabled=yes"], "serviceMonitor.enabled"),
    ("bad pull policy", ["--set", "image.pullPolicy=Sometimes"], "image.pullPolicy"),
    ("negative GPU count", ["--set", "gpu.count=-1"], "gpu.count"),
    ("bad resource quantity", ["--set", "resources.limits.memory=lots"], "resources.limits.memory"),
    ("bad PDB value", ["--set", "podDisruptionBudget.maxUnavailable=half"], "podDisruptionBudget.maxUnavailable"),
    ("bad service type", ["--set", "service.type=Ingress"], "service.type"),
    ("tolerations not a list", ["--set", "tolerations=none"], "tolerations"),
    ("unknown state volume", ["--set", "state.volume=pvc"], "state.volume"),
    ("relative state hostPath", ["--set", "state.hostPath=var/lib"], "state.hostPath"),
    ("tenant memory share zero", ["--set", "daemon.tenantMemoryShare=0"], "daemon.tenantMemoryShare"),
    ("tenant memory share over one", ["--set", "daemon.tenantMemoryShare=1.5"], "daemon.tenantMemoryShare"),
    ("TLS Secret name not a DNS name", ["--set", "tls.secretName=Bad_Name"], "tls.secretName"),
    ("unknown tls key", ["--set", "tls.cert=x"], "cert"),
    ("unknown kv transfer", ["--set", "handoff.kvTransfer=tcp"], "handoff.kvTransfer"),
    ("kv transfer of an enabled hand-off", ["--set", "handoff.enabled=true,handoff.kvTransfer=rdma"],
     "handoff.kvTransfer"),
    ("peer port zero", ["--set", "handoff.port=0"], "handoff.port"),
    ("peer port over 65535", ["--set", "handoff.port=65536"], "handoff.port"),
    ("peer port as a string", ["--set-string", "handoff.port=50061"], "handoff.port"),
    ("import bytes in flight zero", ["--set", "handoff.maxImportBytesInFlight=0"],
     "handoff.maxImportBytesInFlight"),
    ("hand-off enabled as a string", ["--set-string", "handoff.enabled=true"], "handoff.enabled"),
    ("peer token Secret not a DNS name", ["--set", "handoff.peerToken.secretName=Peer_Token"],
     "handoff.peerToken.secretName"),
    ("peer token key empty", ["--set", "handoff.peerToken.secretKey="], "handoff.peerToken.secretKey"),
    ("peer CA from a Secret and a ConfigMap",
     ["--set", "handoff.peerCa.secretName=a,handoff.peerCa.configMapName=b"], "handoff.peerCa"),
    ("UCX environment not UCX_", ["--set", "handoff.ucxEnv.LD_PRELOAD=x"], "handoff.ucxEnv"),
    ("UCX port range past 65535", ["--set", "handoff.ucxTcpPortRange.end=70000"], "handoff.ucxTcpPortRange.end"),
    ("NetworkPolicy extra peer not an object", ["--set", "handoff.networkPolicy.extraPeers[0]=all"],
     "handoff.networkPolicy.extraPeers"),
    ("unknown hand-off key", ["--set", "handoff.peerListen=0.0.0.0:1"], "peerListen"),
    ("Kubernetes without gRPC probes", ["--kube-version", "1.26.0"], "kubeVersion"),
]
SCHEMA_ERROR = "values don't meet the specifications of the schema"

# (what, helm arguments, text the error must contain): values the schema accepts but the
# chart's templates refuse (comparisons between values).
HANDOFF_ON = "handoff.enabled=true"
TEMPLATE_REJECTIONS = [
    ("peer port equal to the gRPC port", ["--set", f"{HANDOFF_ON},handoff.port=50051"],
     "handoff.port 50051 is also ports.grpc"),
    ("peer port equal to the metrics port", ["--set", f"{HANDOFF_ON},handoff.port=9464"],
     "handoff.port 9464 is also ports.metrics"),
    ("peer port equal to the health port with TLS",
     ["--set", f"{HANDOFF_ON},handoff.port=50052,tls.secretName=t"], "handoff.port 50052 is also ports.health"),
    ("UCX port range with one end", ["--set", f"{HANDOFF_ON},handoff.ucxTcpPortRange.start=40000"],
     "set both start and end"),
    ("UCX port range reversed",
     ["--set", f"{HANDOFF_ON},handoff.ucxTcpPortRange.start=40100,handoff.ucxTcpPortRange.end=40000"],
     "start 40100 is above end 40000"),
    ("UCX port range over the peer port",
     ["--set", f"{HANDOFF_ON},handoff.ucxTcpPortRange.start=50060,handoff.ucxTcpPortRange.end=50070"],
     "50060-50070 holds handoff.port (50061)"),
    ("UCX port range set twice",
     ["--set", f"{HANDOFF_ON},handoff.ucxTcpPortRange.start=40000,handoff.ucxTcpPortRange.end=40100,"
      "handoff.ucxEnv.UCX_TCP_PORT_RANGE=1-2"], "set one of them"),
]

# Hand-off values that must leave no trace while handoff.enabled is false.
HANDOFF_DISABLED = ["--set", "handoff.port=7100,handoff.kvTransfer=grpc,handoff.maxImportBytesInFlight=1024,"
                    "handoff.peerToken.secretName=p,handoff.peerCa.configMapName=c,handoff.ucxEnv.UCX_TLS=tcp,"
                    "handoff.ucxTcpPortRange.start=40000,handoff.ucxTcpPortRange.end=40100,"
                    "handoff.networkPolicy.enabled=true"]
PEER_TOKEN_DIR, PEER_CA_DIR = "/etc/kvcached/peer-token", "/etc/kvcached/peer-ca"


def helm(args, binary):
    return subprocess.run([binary] + args, capture_output=True, text=True)


def merge(base, override):
    """Helm's coalescing of user values over the chart's: a null deletes the key."""
    out = copy.deepcopy(base)
    for k, v in (override or {}).items():
        if v is None:
            out.pop(k, None)
        elif isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def subset(small, big):
    return all(big.get(k) == v for k, v in (small or {}).items())


def expected_args(v):
    d = v["daemon"]
    args = [f"--listen=0.0.0.0:{v['ports']['grpc']}",
            f"--metrics_listen=0.0.0.0:{v['ports']['metrics']}",
            f"--backend={d['backend']}"]
    for key, flag in [("maxSequences", "max_sequences"), ("idleTimeout", "idle_timeout"),
                      ("drainDeadline", "drain_deadline"), ("maxMessageBytes", "max_message_bytes"),
                      ("maxStreams", "max_streams"), ("keepaliveTime", "keepalive_time"),
                      ("keepaliveTimeout", "keepalive_timeout"),
                      ("poolMemoryBytes", "pool_memory_bytes"), ("tpRanks", "tp_ranks"),
                      ("kvLayers", "kv_layers"), ("kvHeads", "kv_heads"), ("kvHeadDim", "kv_head_dim"),
                      ("kvTokensPerBlock", "kv_tokens_per_block"), ("kvDtype", "kv_dtype"),
                      ("kvSharedMemory", "kv_shared_memory"),
                      ("maxSequenceTokens", "max_sequence_tokens"),
                      ("memoryLimitBytes", "memory_limit_bytes"),
                      ("streamIdleTimeout", "stream_idle_timeout"),
                      ("maxConnections", "max_connections"),
                      ("listenerProbeInterval", "listener_probe_interval"),
                      ("diagnosticsEvery", "diagnostics_every"),
                      ("diagnosticsSample", "diagnostics_sample"),
                      ("tenantMaxSequences", "tenant_max_sequences"),
                      ("tenantMemoryShare", "tenant_memory_share")]:
        if d.get(key) is not None:
            value = str(d[key]).lower() if isinstance(d[key], bool) else d[key]
            args.append(f"--{flag}={value}")
    if v["tls"]["secretName"]:
        args += ["--tls_cert_file=/etc/kvcached/tls/tls.crt",
                 "--tls_key_file=/etc/kvcached/tls/tls.key"]
        if v["tls"]["requireClientCertificates"]:
            args.append("--tls_client_ca_file=/etc/kvcached/client-ca/ca.crt")
        args.append(f"--health_listen=0.0.0.0:{v['ports']['health']}")
    if v["auth"]["tokensSecretName"]:
        args.append("--auth_tokens_file=/etc/kvcached/auth/tokens")
    if keeps_state(v):
        args.append("--state_dir=/var/lib/kvcached")
    h = v["handoff"]
    if h["enabled"]:
        args += [f"--peer_listen=0.0.0.0:{h['port']}", f"--kv_transfer={h['kvTransfer']}"]
        if h.get("maxImportBytesInFlight") is not None:
            args.append(f"--max_import_bytes_in_flight={h['maxImportBytesInFlight']}")
        if h["peerToken"]["secretName"]:
            args.append(f"--peer_token_file={PEER_TOKEN_DIR}/token")
        if h["peerCa"]["secretName"] or h["peerCa"]["configMapName"]:
            args.append(f"--peer_ca_file={PEER_CA_DIR}/ca.crt")
    return args + list(d.get("extraArgs", []))


def ucx_port_range(h):
    r = h.get("ucxTcpPortRange") or {}
    return (r["start"], r["end"]) if r.get("start") is not None and r.get("end") is not None else None


def check_handoff(expect, v, c, pod, pod_labels, by_kind):
    """The hand-off: the peer port on the container and the Service, the peer token and CA
    mounted where their flags point, the UCX environment, the NetworkPolicy; and no trace
    of any of it while handoff.enabled is false."""
    h = v["handoff"]
    ports = {p["name"]: p for p in c.get("ports", [])}
    mounts = {m["mountPath"]: m for m in c.get("volumeMounts", [])}
    vols = {x["name"]: x for x in pod.get("volumes", [])}
    env = [e["name"] for e in c.get("env", [])]
    svc_ports = {p["name"]: p for s in by_kind.get("Service", []) for p in s["spec"]["ports"]}
    policies = by_kind.get("NetworkPolicy", [])
    if not h["enabled"]:
        expect("peer" not in ports and "peer" not in svc_ports, "a peer port without handoff.enabled")
        expect(not {PEER_TOKEN_DIR, PEER_CA_DIR} & set(mounts), "peer Secrets mounted without handoff.enabled")
        expect(not [n for n in env if n.startswith("UCX_")], "UCX environment without handoff.enabled")
        expect(not policies, "a NetworkPolicy without handoff.enabled")
        return
    p = ports.get("peer", {})
    expect(p.get("containerPort") == h["port"] and p.get("protocol") == "TCP",
           f"container port peer must be TCP {h['port']}, got {p}")
    expect("hostPort" not in p, "the peer port must not be bound on the node")
    if v["service"]["enabled"]:
        sp = svc_ports.get("peer", {})
        expect(sp.get("port") == h["port"] and sp.get("targetPort") == "peer", f"Service port peer: {sp}")

    def mounted(path, source_kind, name, key):
        m = mounts.get(path)
        if not expect(m is not None, f"nothing mounted at {path}"):
            return
        expect(m.get("readOnly") is True, f"{path} must be mounted read-only")
        vol = vols.get(m["name"], {})
        src = vol.get(source_kind)
        if not expect(src is not None, f"{path} must come from a {source_kind}, got {vol}"):
            return
        got = src.get("secretName" if source_kind == "secret" else "name")
        expect(got == name, f"{path}: {source_kind} {got!r} != {name!r}")
        file = "token" if path == PEER_TOKEN_DIR else "ca.crt"
        expect(src.get("items") == [{"key": key, "path": file}], f"{path}: items {src.get('items')}")
        expect(src.get("defaultMode") == 0o440, f"{path}: files must be mode 0440")

    tok, ca = h["peerToken"], h["peerCa"]
    if tok["secretName"]:
        mounted(PEER_TOKEN_DIR, "secret", tok["secretName"], tok["secretKey"])
    else:
        expect(PEER_TOKEN_DIR not in mounts, "a peer token mounted without handoff.peerToken.secretName")
    if ca["secretName"]:
        mounted(PEER_CA_DIR, "secret", ca["secretName"], ca["key"])
    elif ca["configMapName"]:
        mounted(PEER_CA_DIR, "configMap", ca["configMapName"], ca["key"])
    else:
        expect(PEER_CA_DIR not in mounts, "a peer CA mounted without handoff.peerCa")

    want_env = {k: str(x) for k, x in (h.get("ucxEnv") or {}).items()}
    span = ucx_port_range(h)
    if span:
        want_env["UCX_TCP_PORT_RANGE"] = f"{span[0]}-{span[1]}"
    got_env = {e["name"]: e.get("value") for e in c.get("env", []) if e["name"].startswith("UCX_")}
    expect(got_env == want_env, f"UCX environment {got_env} != {want_env}")
    expect(len(env) == len(set(env)), f"duplicate environment variables {env}")

    if not expect(len(policies) == (1 if h["networkPolicy"]["enabled"] else 0), f"{len(policies)} NetworkPolicies"):
        return
    if policies:
        check_network_policy(expect, v, policies[0], pod_labels)


def check_network_policy(expect, v, np, pod_labels):
    """The policy selects the daemons, keeps their other ports open to every source, and
    lets only this chart's daemons (and extraPeers) reach the peer port and UCX's ports."""
    h, spec = v["handoff"], np["spec"]
    expect(np["apiVersion"] == "networking.k8s.io/v1", "NetworkPolicy must be networking.k8s.io/v1")
    expect(subset(spec["podSelector"]["matchLabels"], pod_labels), "NetworkPolicy does not select the pods")
    expect(spec.get("policyTypes") == ["Ingress"], "NetworkPolicy must restrict ingress only")
    rules = spec.get("ingress", [])
    open_rules = [r for r in rules if "from" not in r]
    peer_rules = [r for r in rules if "from" in r]
    if not expect(len(open_rules) == 1 and len(peer_rules) == 1, f"ingress rules {rules}"):
        return
    open_ports = {p["port"] for p in open_rules[0]["ports"]}
    want_open = {"grpc", "metrics"} | ({"health"} if v["tls"]["secretName"] else set())
    expect(open_ports == want_open, f"ports open to every source {open_ports} != {want_open}")
    peer = peer_rules[0]
    want_ports = [{"port": "peer", "protocol": "TCP"}]
    span = ucx_port_range(h)
    if span:
        want_ports.append({"port": span[0], "endPort": span[1], "protocol": "TCP"})
    expect(peer["ports"] == want_ports, f"peer rule ports {peer['ports']} != {want_ports}")
    chart_pods = {"podSelector": {"matchLabels": {"app.kubernetes.io/name": "kvcache-manager",
                                                  "app.kubernetes.io/component": "kvcached"}}}
    want_from = [chart_pods] + list(h["networkPolicy"].get("extraPeers") or [])
    expect(peer["from"] == want_from, f"peer rule sources {peer['from']} != {want_from}")
    expect(subset(chart_pods["podSelector"]["matchLabels"], pod_labels),
           "the chart's own pods are not among the peer sources")


def keeps_state(v):
    """kvcached takes --state_dir only with host pools in shared memory (or none)."""
    d = v["daemon"]
    return v["state"]["enabled"] and d["backend"] != "cuda" and d.get("kvSharedMemory") is not False


def check_secrets_and_state(expect, v, c, pod):
    """TLS, token and state volumes: each Secret mounted read-only where its flag points,
    with only the keys the daemon reads; the state directory on its volume."""
    mounts = {m["mountPath"]: m for m in c.get("volumeMounts", [])}
    vols = {x["name"]: x for x in pod.get("volumes", [])}

    def secret_at(path, secret, items):
        m = mounts.get(path)
        if not expect(m is not None, f"nothing mounted at {path}"):
            return
        expect(m.get("readOnly") is True, f"{path} must be mounted read-only")
        vol = vols.get(m["name"], {}).get("secret", {})
        expect(vol.get("secretName") == secret, f"{path}: Secret {vol.get('secretName')!r} != {secret!r}")
        expect(vol.get("items") == items, f"{path}: items {vol.get('items')} != {items}")
        expect(vol.get("defaultMode") == 0o440, f"{path}: the Secret's files must be mode 0440")

    tls, auth, state = v["tls"], v["auth"], v["state"]
    if tls["secretName"]:
        secret_at("/etc/kvcached/tls", tls["secretName"],
                  [{"key": "tls.crt", "path": "tls.crt"}, {"key": "tls.key", "path": "tls.key"}])
        if tls["requireClientCertificates"]:
            secret_at("/etc/kvcached/client-ca", tls["clientCaSecretName"] or tls["secretName"],
                      [{"key": "ca.crt", "path": "ca.crt"}])
        ports = {p["name"]: p.get("containerPort") for p in c.get("ports", [])}
        expect(ports.get("health") == v["ports"]["health"], "the plaintext health port is not declared")
    else:
        expect(not {"/etc/kvcached/tls", "/etc/kvcached/client-ca"} & set(mounts),
               "TLS Secrets mounted without tls.secretName")
    if auth["tokensSecretName"]:
        secret_at("/etc/kvcached/auth", auth["tokensSecretName"],
                  [{"key": auth["tokensSecretKey"], "path": "tokens"}])
    else:
        expect("/etc/kvcached/auth" not in mounts, "a token Secret mounted without auth.tokensSecretName")
    m = mounts.get("/var/lib/kvcached")
    if not keeps_state(v):
        expect(m is None, "a state volume mounted without a snapshot to keep")
        return
    if not expect(m is not None and not m.get("readOnly"), "the state directory must be mounted writable"):
        return
    vol = vols.get(m["name"], {})
    if state["volume"] == "hostPath":
        expect(vol.get("hostPath") == {"path": state["hostPath"], "type": "DirectoryOrCreate"},
               f"state hostPath {vol.get('hostPath')}")
    else:
        expect(vol.get("emptyDir", {}).get("sizeLimit") == state["sizeLimit"]
               and "medium" not in vol.get("emptyDir", {}),
               f"state must be a disk emptyDir of {state['sizeLimit']}, got {vol}")


def check_render(name, objs, text, v, api, f):
    def expect(ok, msg):
        return f.check(ok, f"[{name}] {msg}")

    by_kind = {}
    for o in objs:
        by_kind.setdefault(o["kind"], []).append(o)
        expect(o["metadata"].get("namespace") == (v["dashboard"].get("namespace") or NAMESPACE)
               if o["kind"] == "ConfigMap" else o["metadata"].get("namespace") == NAMESPACE,
               f"{o['kind']} {o['metadata']['name']} is not in namespace {NAMESPACE}")
        labels = o["metadata"].get("labels", {})
        expect(labels.get("app.kubernetes.io/name") == "kvcache-manager"
               and labels.get("app.kubernetes.io/instance") == RELEASE,
               f"{o['kind']} {o['metadata']['name']} lacks the app.kubernetes.io labels")
    kind = v["workload"]["kind"]
    other = "Deployment" if kind == "DaemonSet" else "DaemonSet"
    if not expect(len(by_kind.get(kind, [])) == 1, f"renders {len(by_kind.get(kind, []))} {kind}"):
        return
    expect(other not in by_kind, f"renders a {other} besides the {kind}")
    w = by_kind[kind][0]
    spec, pod = w["spec"], w["spec"]["template"]["spec"]
    pod_labels = w["spec"]["template"]["metadata"]["labels"]
    expect(subset(spec["selector"]["matchLabels"], pod_labels), "selector does not match the pod labels")
    if kind == "Deployment":
        expect(spec.get("replicas") == v["workload"]["replicas"], f"replicas {spec.get('replicas')}")
    else:
        expect("replicas" not in spec, "a DaemonSet has no replicas")
    if v["workload"].get("updateStrategy"):
        key = "strategy" if kind == "Deployment" else "updateStrategy"
        expect(spec.get(key) == v["workload"]["updateStrategy"], f"{key} not rendered")

    # Pod: restricted security, scheduling.
    psc = pod.get("securityContext", {})
    expect(psc.get("runAsNonRoot") is True, "pod runAsNonRoot must be true")
    expect(isinstance(psc.get("runAsUser"), int) and psc["runAsUser"] > 0, "pod runAsUser must be a non-root UID")
    expect(psc.get("seccompProfile", {}).get("type") == "RuntimeDefault", "pod seccompProfile RuntimeDefault")
    for key in ("nodeSelector", "tolerations", "affinity"):
        want = v.get(key) or None
        expect(pod.get(key) == want, f"{key}: rendered {pod.get(key)!r}, values {want!r}")
    expect(pod.get("runtimeClassName") == (v.get("runtimeClassName") or None), "runtimeClassName")
    expect(bool(pod.get("hostIPC")) == bool(v.get("hostIPC")), "hostIPC")
    if v["serviceAccount"]["create"]:
        sas = by_kind.get("ServiceAccount", [])
        expect(len(sas) == 1 and sas[0]["metadata"]["name"] == pod.get("serviceAccountName"),
               "the pod must use the chart's ServiceAccount")
    else:
        expect("ServiceAccount" not in by_kind, "serviceAccount.create false renders a ServiceAccount")
        expect(pod.get("serviceAccountName") == "default", "serviceAccountName must be default")
    expect(pod.get("automountServiceAccountToken") is False, "automountServiceAccountToken must be false")

    # Container.
    cs = pod["containers"]
    if not expect(len(cs) == 1 and cs[0]["name"] == "kvcached", "one container named kvcached"):
        return
    c = cs[0]
    grpc, metrics = v["ports"]["grpc"], v["ports"]["metrics"]
    expect(c.get("args") == expected_args(v), f"args {c.get('args')} != {expected_args(v)}")
    expect("command" not in c, "the image's ENTRYPOINT runs kvcached: no command")
    tag = ("0.1.0-cuda" if v["daemon"]["backend"] == "cuda" else "0.1.0")
    expect(c["image"] == f"{v['image']['repository']}:{tag}", f"image {c['image']}")
    ports = {p["name"]: p for p in c.get("ports", [])}
    expect(ports.get("grpc", {}).get("containerPort") == grpc, f"container port grpc != {grpc}")
    expect(ports.get("metrics", {}).get("containerPort") == metrics, f"container port metrics != {metrics}")
    expect(("hostPort" in ports.get("grpc", {})) == bool(v["ports"].get("hostPort")), "hostPort")
    for probe, key in (("liveness", "livenessProbe"), ("readiness", "readinessProbe"), ("startup", "startupProbe")):
        pv = v["probes"][probe]
        if not pv["enabled"]:
            expect(key not in c, f"{key} rendered although disabled")
            continue
        p = c.get(key, {})
        # The kubelet's gRPC probes cannot speak TLS: with it they use the plaintext health port.
        probe_port = v["ports"]["health"] if v["tls"]["secretName"] else grpc
        expect(p.get("grpc") == {"port": probe_port, "service": pv["service"]},
               f"{key} must be grpc {{port: {probe_port}, service: {pv['service']!r}}}, got {p.get('grpc')}")
        expect(not ({"httpGet", "exec", "tcpSocket"} & set(p)), f"{key} has another handler")
    if name.startswith("default"):
        expect(c["livenessProbe"]["grpc"]["service"] == "", "liveness checks the whole server")
        expect(c["readinessProbe"]["grpc"]["service"] == "kvcache.v1.KvCache",
               "readiness checks kvcache.v1.KvCache")
    sc = c.get("securityContext", {})
    expect(sc.get("runAsNonRoot") is True, "container runAsNonRoot must be true")
    expect(sc.get("readOnlyRootFilesystem") is True, "readOnlyRootFilesystem must be true")
    expect(sc.get("allowPrivilegeEscalation") is False, "allowPrivilegeEscalation must be false")
    expect(sc.get("privileged") in (None, False), "privileged must be false")
    expect(sc.get("capabilities", {}).get("drop") == ["ALL"], "capabilities must drop ALL")
    expect(not sc.get("capabilities", {}).get("add"), "capabilities must add none")
    expect(sc.get("seccompProfile", {}).get("type") == "RuntimeDefault", "container seccompProfile RuntimeDefault")
    mounts = {m["mountPath"]: m["name"] for m in c.get("volumeMounts", [])}
    vols = {x["name"]: x for x in pod.get("volumes", [])}
    expect("/tmp" in mounts and "emptyDir" in vols.get(mounts.get("/tmp"), {}), "/tmp must be an emptyDir")
    check_secrets_and_state(expect, v, c, pod)
    check_handoff(expect, v, c, pod, pod_labels, by_kind)

    # GPUs: nvidia.com/gpu only on the cuda backend with a GPU count.
    res = c.get("resources", {})
    gpu_name, count = v["gpu"]["resourceName"], v["gpu"]["count"]
    if v["daemon"]["backend"] == "cuda" and count > 0:
        expect(res.get("limits", {}).get(gpu_name) == count, f"limits.{gpu_name} must be {count}")
        expect(res.get("limits", {}).get("memory") == v["resources"]["limits"]["memory"],
               "the GPU request must keep the other limits")
    else:
        expect(gpu_name not in json.dumps(res), f"{gpu_name} requested without the cuda backend and a count")
        if v["daemon"]["backend"] != "cuda":
            expect("nvidia.com/gpu" not in text, "nvidia.com/gpu appears in a host-backend render")
    for section in ("requests", "limits"):
        for k, want in (v.get("resources", {}).get(section) or {}).items():
            expect(res.get(section, {}).get(k) == want, f"resources.{section}.{k} != {want}")

    # Service.
    svcs = by_kind.get("Service", [])
    if expect(len(svcs) == 1, f"{len(svcs)} Services"):
        s = svcs[0]
        sp = {p["name"]: p for p in s["spec"]["ports"]}
        expect(sp.get("grpc", {}).get("port") == grpc and sp["grpc"].get("targetPort") == "grpc",
               "Service port grpc")
        expect(sp.get("metrics", {}).get("port") == metrics and sp["metrics"].get("targetPort") == "metrics",
               "Service port metrics")
        expect(subset(s["spec"]["selector"], pod_labels), "Service selector does not match the pods")
        want_policy = v["service"].get("internalTrafficPolicy") or ("Local" if kind == "DaemonSet" else None)
        expect(s["spec"].get("internalTrafficPolicy") == want_policy, "internalTrafficPolicy")

    # ServiceMonitor and PrometheusRule: only when enabled and the API exists.
    sm_want = v["serviceMonitor"]["enabled"] and api
    sms = by_kind.get("ServiceMonitor", [])
    expect(len(sms) == (1 if sm_want else 0),
           f"{len(sms)} ServiceMonitors (enabled {v['serviceMonitor']['enabled']}, API {api})")
    if sms and svcs:
        sm = sms[0]
        ep = sm["spec"]["endpoints"]
        expect(len(ep) == 1 and ep[0].get("port") == "metrics" and ep[0].get("path") == "/metrics",
               "ServiceMonitor must scrape port metrics, path /metrics")
        expect(ep[0].get("interval") == v["serviceMonitor"]["interval"], "ServiceMonitor interval")
        expect(subset(sm["spec"]["selector"]["matchLabels"], svcs[0]["metadata"]["labels"]),
               "ServiceMonitor selector does not match the Service")
        job = svcs[0]["metadata"]["labels"].get(sm["spec"].get("jobLabel"))
        expect(job == "kvcached", f'jobLabel gives job {job!r}; the rules expect "kvcached"')
        expect(sm["spec"].get("namespaceSelector") == {"matchNames": [NAMESPACE]}, "namespaceSelector")
        expect(subset(v["serviceMonitor"]["labels"], sm["metadata"]["labels"]), "ServiceMonitor labels")
    pr_want = v["prometheusRule"]["enabled"] and api
    prs = by_kind.get("PrometheusRule", [])
    expect(len(prs) == (1 if pr_want else 0),
           f"{len(prs)} PrometheusRules (enabled {v['prometheusRule']['enabled']}, API {api})")
    if prs:
        expect(prs[0]["spec"] == dl.load_rules(), "PrometheusRule spec differs from rules/kvcache.rules.yaml")
        expect("{{ $labels.pod }}" in text, "PrometheusRule lost the Prometheus templates")

    # PodDisruptionBudget.
    pdbs = by_kind.get("PodDisruptionBudget", [])
    pv = v["podDisruptionBudget"]
    expect(len(pdbs) == (1 if pv["enabled"] else 0), f"{len(pdbs)} PodDisruptionBudgets")
    if pdbs:
        p = pdbs[0]
        expect(p["apiVersion"] == "policy/v1", "PodDisruptionBudget must be policy/v1")
        expect(subset(p["spec"]["selector"]["matchLabels"], pod_labels), "PDB selector does not match the pods")
        if pv.get("minAvailable") is not None:
            expect(p["spec"] == {"minAvailable": pv["minAvailable"], "selector": p["spec"]["selector"]},
                   f"PDB must set only minAvailable {pv['minAvailable']}")
        else:
            expect(p["spec"].get("maxUnavailable") == pv["maxUnavailable"] and "minAvailable" not in p["spec"],
                   f"PDB must set only maxUnavailable {pv['maxUnavailable']}")

    # Dashboard ConfigMap.
    cms = [o for o in by_kind.get("ConfigMap", []) if o["metadata"]["name"] == f"{FULLNAME}-dashboard"]
    expect(len(cms) == (1 if v["dashboard"]["enabled"] else 0), f"{len(cms)} dashboard ConfigMaps")
    if cms:
        cm = cms[0]
        expect(cm["metadata"]["labels"].get("grafana_dashboard") == "1", 'label grafana_dashboard: "1"')
        expect(json.loads(cm["data"]["kvcache.json"]) == dl.load_dashboard(),
               "the ConfigMap's dashboard differs from dashboards/kvcache.json")


def run_lint(args, f):
    files = [None] + sorted(VALUES_DIR.glob("*.yaml"))
    for values in files:
        extra = ["-f", str(values)] if values else []
        r = helm(["lint", "--strict", str(dl.CHART)] + extra, args.helm)
        what = values.name if values else "chart defaults"
        f.check(r.returncode == 0, f"helm lint --strict ({what}):\n{r.stdout}{r.stderr}")
        print(f"lint {what}: {'ok' if r.returncode == 0 else 'FAILED'}")
    f.exit("helm lint")


def run_render(args, f):
    defaults = yaml.safe_load((dl.CHART / "values.yaml").read_text())
    used = {c[1] for c in CASES}
    for p in sorted(VALUES_DIR.glob("*.yaml")):
        f.check(p.name in used, f"values/{p.name} is in no case of check_helm.py")
    for name, file, extra, api in CASES:
        values_file = VALUES_DIR / file
        r = helm(["template", RELEASE, str(dl.CHART), "--namespace", NAMESPACE,
                  "-f", str(values_file)] + extra, args.helm)
        if not f.check(r.returncode == 0, f"[{name}] helm template failed:\n{r.stderr}"):
            continue
        try:
            objs = dl.load_all_unique(r.stdout)
        except yaml.YAMLError as e:
            f.fail(f"[{name}] rendered YAML does not parse: {e}")
            continue
        v = merge(defaults, yaml.safe_load(values_file.read_text()))
        before = len(f.items)
        check_render(name, objs, r.stdout, v, api, f)
        kinds = ", ".join(sorted(o["kind"] for o in objs))
        print(f"render {name}: {'ok' if len(f.items) == before else 'FAILED'} ({kinds})")
    base = ["template", RELEASE, str(dl.CHART), "--namespace", NAMESPACE]
    plain, disabled = helm(base, args.helm), helm(base + HANDOFF_DISABLED, args.helm)
    same = plain.returncode == 0 and disabled.returncode == 0 and plain.stdout == disabled.stdout
    f.check(same, "hand-off values change the render while handoff.enabled is false:\n"
            f"{disabled.stderr}{''.join(render_diff(plain.stdout, disabled.stdout))}")
    print(f"render hand-off disabled leaves no trace: {'ok' if same else 'FAILED'}")
    f.exit("helm template matrix")


def render_diff(a, b):
    return list(difflib.unified_diff(a.splitlines(True), b.splitlines(True), "defaults", "hand-off disabled"))[:40]


def run_schema(args, f):
    base = ["template", RELEASE, str(dl.CHART), "--namespace", NAMESPACE]
    r = helm(base, args.helm)
    f.check(r.returncode == 0, f"the defaults must render:\n{r.stderr}")
    for what, extra, needle in REJECTIONS:
        r = helm(base + extra, args.helm)
        if not f.check(r.returncode != 0, f"{what} ({' '.join(extra)}) was accepted"):
            continue
        ok = needle in r.stderr and (SCHEMA_ERROR in r.stderr or needle == "kubeVersion")
        f.check(ok, f"{what} ({' '.join(extra)}) failed for another reason:\n{r.stderr.strip()}")
        print(f"rejects {what}: {'ok' if ok else 'FAILED'}")
    for what, extra, needle in TEMPLATE_REJECTIONS:
        r = helm(base + extra, args.helm)
        if not f.check(r.returncode != 0, f"{what} ({' '.join(extra)}) was accepted"):
            continue
        ok = needle in r.stderr and SCHEMA_ERROR not in r.stderr
        f.check(ok, f"{what} ({' '.join(extra)}) failed for another reason:\n{r.stderr.strip()}")
        print(f"rejects {what}: {'ok' if ok else 'FAILED'}")
    f.exit("values.schema.json rejections")


def run_flags(args, f):
    if not args.kvcached:
        sys.exit("flags needs --kvcached")
    r = subprocess.run([args.kvcached, "--help"], capture_output=True, text=True, timeout=60)
    known = set(re.findall(r"--([a-z0-9_]+)", r.stdout + r.stderr))
    f.check(len(known) > 20, f"kvcached --help lists {len(known)} flags:\n{r.stdout}{r.stderr}")
    rendered = set()
    for name, file, extra, _ in CASES:
        r = helm(["template", RELEASE, str(dl.CHART), "--namespace", NAMESPACE,
                  "-f", str(VALUES_DIR / file)] + extra, args.helm)
        if not f.check(r.returncode == 0, f"[{name}] helm template failed:\n{r.stderr}"):
            continue
        values = yaml.safe_load((VALUES_DIR / file).read_text()) or {}
        verbatim = set((values.get("daemon") or {}).get("extraArgs") or [])
        for o in dl.load_all_unique(r.stdout):
            if o["kind"] not in ("DaemonSet", "Deployment"):
                continue
            for arg in o["spec"]["template"]["spec"]["containers"][0]["args"]:
                if arg not in verbatim:
                    rendered.add(arg.split("=", 1)[0][2:])
    for flag in sorted(rendered):
        f.check(flag in known, f"the chart renders --{flag}, which kvcached does not know")
    print(f"flags: {len(rendered)} rendered, {len(rendered - known)} unknown to kvcached")
    f.exit("chart flags known to kvcached")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--helm", required=True, help="the helm binary (tests/deploy/fetch_helm.sh)")
    ap.add_argument("--kvcached", help="the kvcached binary (mode flags)")
    ap.add_argument("mode", choices=["lint", "render", "schema", "flags"])
    args = ap.parse_args()
    if not pathlib.Path(args.helm).is_file():
        sys.exit(f"{args.helm} not found: run tests/deploy/fetch_helm.sh (ctest runs it as deploy_helm_fetch)")
    {"lint": run_lint, "render": run_render, "schema": run_schema,
     "flags": run_flags}[args.mode](args, dl.Failures())


if __name__ == "__main__":
    main()
