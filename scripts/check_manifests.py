#!/usr/bin/env python3
"""Offline checks of rackfill's deployment files (deploy/), for CI.

1. Every YAML document under deploy/k8s/ is validated against the schema of its kind:
   LeaderWorkerSet and ComputeDomain against the full openAPIV3Schema of their CRDs, vendored as
   JSON in deploy/k8s/schemas/ (README.md there says where each came from), made strict the way
   the API server's field validation is: an object schema with `properties` accepts no other
   field unless it says x-kubernetes-preserve-unknown-fields or additionalProperties. The
   top-level metadata (just `type: object` in a CRD) and core kinds (Service) get a minimal
   structural schema written here.
2. The objects agree with each other and with rackfill's launch contract: the ComputeDomain's
   claim template is claimed by every pod and container, the Service selects the LWS leader pods
   and a port they have, EP size = pods x GPUs, readiness on /health, heartbeat liveness, etc.
3. Shell scripts parse (`bash -n`), the heartbeat probe script behaves, and the sbatch script's
   #SBATCH directives are well formed, come before the first command, and describe 18 x 4 ranks.
4. Self-test: known-bad variants of the manifests must be rejected, so the checks can fail.

Needs PyYAML and jsonschema (pip install pyyaml jsonschema). Exit 0 when all pass; otherwise
one line per problem and exit 1.
"""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import jsonschema
import yaml

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
SCHEMAS = K8S / "schemas"
SBATCH = DEPLOY / "slurm" / "rackfill-nvl72.sbatch"

CRD_SCHEMAS = {
    ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet"): "leaderworkerset.x-k8s.io_v1_leaderworkerset.json",
    ("resource.nvidia.com/v1beta1", "ComputeDomain"): "resource.nvidia.com_v1beta1_computedomain.json",
}
DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
QUALIFIED_NAME = r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"
LABEL_VALUE = r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$"
OBJECT_META = {
    "type": "object",
    "required": ["name"],
    "additionalProperties": False,
    "properties": {
        "name": {"type": "string", "pattern": DNS_LABEL, "maxLength": 63},
        "namespace": {"type": "string", "pattern": DNS_LABEL, "maxLength": 63},
        "labels": {
            "type": "object",
            "propertyNames": {"pattern": QUALIFIED_NAME},
            "additionalProperties": {"type": "string", "pattern": LABEL_VALUE, "maxLength": 63},
        },
        "annotations": {"type": "object", "propertyNames": {"pattern": QUALIFIED_NAME},
                        "additionalProperties": {"type": "string"}},
    },
}
INT_OR_NAME = {"anyOf": [{"type": "integer", "minimum": 1, "maximum": 65535},
                         {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", "maxLength": 15}]}
# core/v1 Service: the ServiceSpec field names of Kubernetes 1.34; the fields rackfill uses typed.
SERVICE = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "v1"},
        "kind": {"const": "Service"},
        "metadata": OBJECT_META,
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "required": ["ports"],
            "properties": {
                **{name: {} for name in (
                    "allocateLoadBalancerNodePorts", "clusterIPs", "externalIPs", "externalName",
                    "externalTrafficPolicy", "healthCheckNodePort", "internalTrafficPolicy",
                    "ipFamilies", "ipFamilyPolicy", "loadBalancerClass", "loadBalancerIP",
                    "loadBalancerSourceRanges", "sessionAffinity", "sessionAffinityConfig",
                    "trafficDistribution")},
                "type": {"enum": ["ClusterIP", "NodePort", "LoadBalancer", "ExternalName"]},
                "clusterIP": {"type": "string"},
                "publishNotReadyAddresses": {"type": "boolean"},
                "selector": {"type": "object", "propertyNames": {"pattern": QUALIFIED_NAME},
                             "additionalProperties": {"type": "string", "pattern": LABEL_VALUE}},
                "ports": {"type": "array", "minItems": 1, "items": {
                    "type": "object",
                    "required": ["port"],
                    "additionalProperties": False,
                    "properties": {
                        "name": {"type": "string", "pattern": DNS_LABEL},
                        "port": {"type": "integer", "minimum": 1, "maximum": 65535},
                        "targetPort": INT_OR_NAME,
                        "nodePort": {"type": "integer"},
                        "protocol": {"enum": ["TCP", "UDP", "SCTP"]},
                        "appProtocol": {"type": "string"},
                    },
                }},
            },
        },
    },
}


def strict(schema):
    """The CRD schema as the API server applies it: unknown fields are errors, not pruned."""
    if isinstance(schema, list):
        return [strict(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: strict(value) for key, value in schema.items()}
    if (out.get("type") == "object" and isinstance(out.get("properties"), dict)
            and "additionalProperties" not in out
            and not out.get("x-kubernetes-preserve-unknown-fields")):
        out["additionalProperties"] = False
    return out


def load_validators() -> dict:
    validators = {}
    for (api_version, kind), file in CRD_SCHEMAS.items():
        schema = strict(json.loads((SCHEMAS / file).read_text()))
        schema["properties"]["metadata"] = OBJECT_META
        schema["properties"]["apiVersion"] = {"const": api_version}
        schema["properties"]["kind"] = {"const": kind}
        schema["required"] = sorted(set(schema.get("required", [])) | {"apiVersion", "kind", "metadata", "spec"})
        validators[(api_version, kind)] = jsonschema.Draft202012Validator(schema)
    validators[("v1", "Service")] = jsonschema.Draft202012Validator(SERVICE)
    return validators


def schema_errors(doc, validators) -> list[str]:
    if not isinstance(doc, dict):
        return ["not a mapping"]
    key = (doc.get("apiVersion"), doc.get("kind"))
    if key not in validators:
        return [f"no schema for apiVersion {key[0]!r} kind {key[1]!r} (known: {sorted(validators)})"]
    return [f"{'.'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}"
            for e in sorted(validators[key].iter_errors(doc), key=lambda e: list(map(str, e.absolute_path)))]


def env_of(container) -> dict:
    return {e["name"]: e.get("value") for e in container.get("env", [])}


def flag_value(args, flag):
    for i, arg in enumerate(args):
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
        if arg == flag and i + 1 < len(args):
            return args[i + 1]
    return None


def contract_errors(docs) -> list[str]:
    """rackfill's launch contract across the objects (what a schema cannot say)."""
    by_kind = {}
    for doc in docs:
        by_kind.setdefault(doc["kind"], []).append(doc)
    for kind in ("LeaderWorkerSet", "ComputeDomain", "Service"):
        if len(by_kind.get(kind, [])) != 1:
            return [f"expected one {kind}, found {len(by_kind.get(kind, []))}"]
    lws, cd, svc = by_kind["LeaderWorkerSet"][0], by_kind["ComputeDomain"][0], by_kind["Service"][0]
    errors = []
    template = lws["spec"]["leaderWorkerTemplate"]
    size = template.get("size", 1)
    if template.get("restartPolicy") != "RecreateGroupOnPodRestart":
        errors.append("LeaderWorkerSet: restartPolicy must be RecreateGroupOnPodRestart (a rank's death restarts the group)")
    if lws["spec"].get("startupPolicy", "LeaderCreated") != "LeaderCreated":
        errors.append("LeaderWorkerSet: startupPolicy must be LeaderCreated (the leader is Ready only once workers run ranks)")
    if "leaderTemplate" not in template:
        errors.append("LeaderWorkerSet: leaderTemplate missing (the leader runs mpirun, workers sshd)")
        return errors
    channel = cd["spec"]["channel"]["resourceClaimTemplate"]["name"]
    pods = {"leader": template["leaderTemplate"], "worker": template["workerTemplate"]}
    gpus_per_pod = set()
    for role, pod in pods.items():
        spec = pod["spec"]
        claims = {c["name"]: c.get("resourceClaimTemplateName") for c in spec.get("resourceClaims", [])}
        if channel not in claims.values():
            errors.append(f"{role} pod: no resourceClaims entry with resourceClaimTemplateName {channel} (the ComputeDomain's)")
        volumes = {v["name"] for v in spec.get("volumes", [])}
        for container in spec["containers"]:
            where = f"{role} container {container['name']}"
            claimed = {c["name"] for c in container.get("resources", {}).get("claims", [])}
            if claimed != set(claims):
                errors.append(f"{where}: resources.claims {sorted(claimed)} != pod resourceClaims {sorted(claims)}")
            for mount in container.get("volumeMounts", []):
                if mount["name"] not in volumes:
                    errors.append(f"{where}: volumeMount {mount['name']} names no volume")
            gpus = str(container.get("resources", {}).get("limits", {}).get("nvidia.com/gpu"))
            env = env_of(container)
            if env.get("RACKFILL_GPUS_PER_POD") != gpus:
                errors.append(f"{where}: RACKFILL_GPUS_PER_POD {env.get('RACKFILL_GPUS_PER_POD')} != nvidia.com/gpu limit {gpus}")
            gpus_per_pod.add(gpus)
            for var in ("NCCL_MNNVL_ENABLE", "NCCL_CUMEM_ENABLE"):
                if env.get(var) != "1":
                    errors.append(f"{where}: {var} must be \"1\" on GB200 NVL72")
            if container.get("command") != ["rackfill-lws", role]:
                errors.append(f"{where}: command must be [rackfill-lws, {role}]")
            liveness = container.get("livenessProbe", {}).get("exec", {}).get("command", [])
            run_dir = env.get("RACKFILL_RUN_DIR")
            if liveness[:3] != ["rackfill-heartbeat-check", run_dir, gpus]:
                errors.append(f"{where}: livenessProbe must run rackfill-heartbeat-check {run_dir} {gpus} (one heartbeat per local rank)")
            if role == "leader":
                ready = container.get("readinessProbe", {}).get("httpGet", {})
                if ready.get("path") != "/health":
                    errors.append(f"{where}: readinessProbe must be httpGet /health (200 only while every rank is alive)")
                # A failing group answers /health 503 for --health-grace before its processes
                # go: long enough for the readiness probe to mark the pod unready first.
                probe = container.get("readinessProbe", {})
                unready_after = probe.get("periodSeconds", 10) * probe.get("failureThreshold", 3)
                grace = flag_value(container.get("args", []), "--health-grace")
                if grace is None or float(grace) < unready_after:
                    errors.append(f"{where}: --health-grace {grace} is shorter than the readiness probe takes to "
                                  f"mark the pod unready ({unready_after} s: periodSeconds x failureThreshold)")
                ep = flag_value(container.get("args", []), "--ep-size")
                if gpus.isdigit() and ep != str(size * int(gpus)):
                    errors.append(f"{where}: --ep-size {ep} != size {size} x {gpus} GPUs per pod")
    if len(gpus_per_pod) != 1:
        errors.append(f"leader and worker pods ask for different GPU counts: {sorted(gpus_per_pod)}")

    # The Service must select leader pods only, by the labels LWS sets on them.
    leader_labels = {"leaderworkerset.sigs.k8s.io/name": lws["metadata"]["name"],
                     "leaderworkerset.sigs.k8s.io/worker-index": "0",
                     **pods["leader"].get("metadata", {}).get("labels", {})}
    worker_labels = {"leaderworkerset.sigs.k8s.io/name": lws["metadata"]["name"],
                     **pods["worker"].get("metadata", {}).get("labels", {})}
    selector = svc["spec"].get("selector", {})
    if not selector or any(leader_labels.get(k) != v for k, v in selector.items()):
        errors.append(f"Service: selector {selector} does not match the leader pods' labels {leader_labels}")
    elif all(worker_labels.get(k) == v for k, v in selector.items()):
        errors.append(f"Service: selector {selector} also matches worker pods (they have no HTTP port)")
    leader_ports = {p.get("name") for c in pods["leader"]["spec"]["containers"] for p in c.get("ports", [])}
    leader_ports |= {p["containerPort"] for c in pods["leader"]["spec"]["containers"] for p in c.get("ports", [])}
    for port in svc["spec"]["ports"]:
        if port.get("targetPort", port["port"]) not in leader_ports:
            errors.append(f"Service: targetPort {port.get('targetPort')} is no port of the leader container")
    return errors


def load_manifests() -> tuple[list, list[str]]:
    docs, errors = [], []
    stray = [p for p in K8S.rglob("*") if p.suffix in (".yaml", ".yml", ".json")
             and p.parent != K8S and p.parent != SCHEMAS]
    errors += [f"{p.relative_to(ROOT)}: manifests belong directly in deploy/k8s/ (kubectl apply -f is not recursive)" for p in stray]
    for path in sorted(K8S.glob("*.y*ml")):
        try:
            for doc in yaml.safe_load_all(path.read_text()):
                if doc is not None:
                    docs.append((path, doc))
        except yaml.YAMLError as error:
            errors.append(f"{path.relative_to(ROOT)}: not valid YAML: {error}".replace("\n", " "))
    if not docs:
        errors.append("deploy/k8s: no manifests")
    return docs, errors


def check_manifests(validators) -> tuple[list[str], list]:
    loaded, errors = load_manifests()
    for path, doc in loaded:
        errors += [f"{path.relative_to(ROOT)}: {doc.get('kind') if isinstance(doc, dict) else '?'}: {e}"
                   for e in schema_errors(doc, validators)]
    docs = [doc for _, doc in loaded]
    if not errors:
        errors += [f"deploy/k8s: {e}" for e in contract_errors(docs)]
    return errors, docs


def self_test(validators, docs) -> list[str]:
    """Known-bad variants must be rejected: otherwise the checks above prove nothing."""
    def lws_of(variant):
        return next(d for d in variant if d["kind"] == "LeaderWorkerSet")

    def mutate(name, change, by_schema):
        variant = copy.deepcopy(docs)
        change(variant)
        found = ([e for d in variant for e in schema_errors(d, validators)] if by_schema
                 else contract_errors(variant))
        return [] if found else [f"self-test: the variant '{name}' was accepted"]

    worker = lambda v: lws_of(v)["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]
    cases = [
        ("unknown LWS field", lambda v: lws_of(v)["spec"]["leaderWorkerTemplate"].update(sizee=18), True),
        ("bad restartPolicy enum", lambda v: lws_of(v)["spec"]["leaderWorkerTemplate"].update(restartPolicy="Always"), True),
        ("unknown pod field", lambda v: worker(v).update(resourceClaim=[]), True),
        ("integer label value", lambda v: next(d for d in v if d["kind"] == "Service")["spec"]["selector"].update(
            {"leaderworkerset.sigs.k8s.io/worker-index": 0}), True),
        ("ComputeDomain without channel", lambda v: next(d for d in v if d["kind"] == "ComputeDomain")["spec"].pop("channel"), True),
        ("unknown kind", lambda v: v.append({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "x"}, "spec": {}}), True),
        ("container without the channel claim", lambda v: worker(v)["containers"][0]["resources"].pop("claims"), False),
        ("wrong claim template", lambda v: worker(v)["resourceClaims"][0].update(resourceClaimTemplateName="other"), False),
        ("Service selecting workers too", lambda v: next(d for d in v if d["kind"] == "Service")["spec"]["selector"].pop(
            "leaderworkerset.sigs.k8s.io/worker-index"), False),
        ("EP size != pods x GPUs", lambda v: lws_of(v)["spec"]["leaderWorkerTemplate"].update(size=16), False),
        ("health grace shorter than the readiness probe", lambda v: lws_of(v)["spec"]["leaderWorkerTemplate"][
            "leaderTemplate"]["spec"]["containers"][0]["readinessProbe"].update(periodSeconds=30), False),
    ]
    errors = []
    for name, change, by_schema in cases:
        errors += mutate(name, change, by_schema)
    return errors


SBATCH_OPTIONS = {
    "job-name", "nodes", "ntasks", "ntasks-per-node", "gpus-per-node", "gres", "gpus-per-task",
    "cpus-per-task", "exclusive", "mem", "time", "signal", "output", "error", "partition",
    "account", "qos", "segment", "network", "reservation", "constraint", "dependency",
}


def check_sbatch() -> list[str]:
    name = SBATCH.relative_to(ROOT)
    errors, directives, first_command = [], {}, None
    for number, line in enumerate(SBATCH.read_text().splitlines(), 1):
        stripped = line.strip()
        if stripped.startswith("#SBATCH"):
            if first_command is not None:
                errors.append(f"{name}:{number}: #SBATCH after the first command (line {first_command}) is ignored by sbatch")
            match = re.fullmatch(r"#SBATCH\s+--([a-z-]+)(?:=(\S+))?\s*", stripped)
            if not match:
                errors.append(f"{name}:{number}: not of the form '#SBATCH --option[=value]': {stripped}")
            elif match.group(1) not in SBATCH_OPTIONS:
                errors.append(f"{name}:{number}: unknown sbatch option --{match.group(1)}")
            else:
                directives[match.group(1)] = match.group(2)
        elif stripped and not stripped.startswith("#") and first_command is None:
            first_command = number
    expected = {"nodes": "18", "ntasks-per-node": "4", "gpus-per-node": "4"}
    for option, value in expected.items():
        if directives.get(option) != value:
            errors.append(f"{name}: --{option} is {directives.get(option)}, expected {value} (one NVL72 rack, one task per GPU)")
    text = SBATCH.read_text()
    for needle in ("srun --mpi=pmix", "--ep-size 72", "NCCL_MNNVL_ENABLE=1", "NCCL_CUMEM_ENABLE=1"):
        if needle not in text:
            errors.append(f"{name}: missing '{needle}'")
    return errors


def check_scripts() -> list[str]:
    scripts = sorted({*DEPLOY.rglob("*.sh"), *DEPLOY.rglob("*.sbatch"), *(DEPLOY / "bin").iterdir()})
    errors = []
    for script in scripts:
        result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
        if result.returncode != 0:
            errors.append(f"{script.relative_to(ROOT)}: bash -n: {result.stderr.strip()}")
        if script.parent.name == "bin" and script.name != "rackfill-await" and not os.access(script, os.X_OK):
            errors.append(f"{script.relative_to(ROOT)}: not executable (the image runs it from PATH)")
    errors += check_heartbeat_probe()
    return errors


def check_heartbeat_probe() -> list[str]:
    probe = DEPLOY / "bin" / "rackfill-heartbeat-check"
    errors = []
    with tempfile.TemporaryDirectory() as run_dir:
        for i in range(2):
            Path(run_dir, f"heartbeat.{i}").touch()
        stale = Path(run_dir, "heartbeat.2")
        stale.touch()
        old = stale.stat().st_mtime - 120
        os.utime(stale, (old, old))
        cases = [((run_dir, "2", "60"), 0), ((run_dir, "3", "60"), 1), ((run_dir, "3", "600"), 0),
                 ((run_dir, "4", "600"), 1), ((run_dir, "x", "60"), 2)]
        for args, want in cases:
            got = subprocess.run(["bash", str(probe), *args], capture_output=True).returncode
            if got != want:
                errors.append(f"rackfill-heartbeat-check {' '.join(args[1:])} on 2 fresh + 1 stale (120 s) files exited {got}, expected {want}")
    return errors


def main() -> int:
    validators = load_validators()
    errors, docs = check_manifests(validators)
    if not errors:
        errors += self_test(validators, docs)
    errors += check_sbatch()
    errors += check_scripts()
    for error in errors:
        print(error, file=sys.stderr)
    if errors:
        return 1
    kinds = ", ".join(sorted({d["kind"] for d in docs}))
    print(f"deploy: {len(docs)} manifests valid ({kinds}), sbatch directives and scripts OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
