"""Kubernetes manifests: a Kubeflow PyTorchJob (one pod per node running torchrun) and a headless
service that gives the first pod a stable name for the c10d rendezvous; a ConfigMap carries a
recipe given as a file, and GB200 jobs get a ComputeDomain (NVIDIA's DRA driver) whose IMEX
channel every pod claims.

Gang scheduling: Kueue. The PyTorchJob carries ``kueue.x-k8s.io/queue-name``; Kueue's Kubeflow
integration admits the job only when the quota for all of its pods is there, so a 48-node job
never holds 40 nodes waiting for 8. Pods tolerate the ``nvidia.com/gpu`` taint and select nodes
by the GPU feature discovery label ``nvidia.com/gpu.product``.

Why a PyTorchJob rather than a JobSet: the Kubeflow training SDK on PyPI (kubeflow-training)
publishes API models for the whole resource, pod templates included (the Kubernetes client's),
so every manifest is checked field by field against published models here; JobSet has no
published Python models, and its envelope could only be checked against a schema written by
hand. The training operator also restarts failed pods, and an interrupted run continues from its
checkpoint in the shared run directory.
"""

from __future__ import annotations

import hashlib
import re
import shlex
import textwrap
from typing import Any

import yaml

from muse_stack.util.errors import InputError, UsageError
from muse_stack.util import quoting
from muse_stack.launch.spec import (CHECKPOINT_MOUNT, CONTAINER_ENV, DATA_MOUNT, RDZV_PORT, RUNS_MOUNT,
                                    LaunchSpec, dns_name)
from muse_stack.recipes.schema import ENV_REFERENCE

HEAD_LABEL = "muse-stack.dev/rendezvous-head"
RUN_LABEL = "muse-stack.dev/run"
#: Kueue admits a job whose pods all fit at once (gang admission) through this label
KUEUE_LABEL = "kueue.x-k8s.io/queue-name"
KUEUE_QUEUE = "muse-stack"
#: the Kubernetes secret whose keys a recipe's ${env:NAME} references name (--env-secret)
ENV_SECRET = "muse-stack-env"
#: where a recipe given as a file is mounted (from its ConfigMap)
RECIPE_MOUNT = "/etc/muse-stack/recipe"
#: NVIDIA's DRA driver: a ComputeDomain gives every pod of a job an IMEX channel in one NVLink domain
COMPUTE_DOMAIN_API = "resource.nvidia.com/v1beta1"
IMEX_CLAIM = "imex-channel"


def object_names(spec: LaunchSpec) -> dict[str, str]:
    """Kubernetes object names: a DNS-1035 label of at most 40 characters (the recipe and a hash of
    the run name), so the training operator's pod and service names (``NAME-worker-1023``) and ours
    (``NAME-rdzv``, ``NAME-imex-channel``) stay within 63 whatever the run name's length. The run
    name itself is a label value and the run directory's name."""
    digest = hashlib.sha256(spec.run_name.encode()).hexdigest()[:8]
    base = f"ms-{dns_name(spec.recipe.name, 26)}-{digest}"
    return {"job": base, "service": f"{base}-rdzv", "recipe": f"{base}-recipe", "domain": f"{base}-imex",
            "channel": f"{base}-imex-channel"}


def _k8s_value(value: str) -> str:
    """Shell-style $VAR / ${VAR} references as Kubernetes' $(VAR) dependent variables, and every other
    ``$`` escaped as ``$$``: Kubernetes expands ``$(NAME)`` in an env value and reads ``$$`` as one ``$``,
    so a literal ``$(NAME)`` (or ``$$``) reaches the container as written, as the sbatch writes it."""
    return re.sub(r"\$\{([A-Za-z_]\w*)\}|\$([A-Za-z_]\w*)|\$",
                  lambda m: f"$({m.group(1) or m.group(2)})" if m.group(1) or m.group(2) else "$$", value)


def _env(spec: LaunchSpec, secret: str) -> list[dict[str, Any]]:
    env: list[dict[str, Any]] = [{"name": k, "value": v} for k, v in CONTAINER_ENV.items()]
    env.append({"name": "MUSE_STACK_RUN_DIR", "value": f"{RUNS_MOUNT}/{spec.run_name}"})
    env.append({"name": "MUSE_STACK_IMAGE", "value": spec.image.oci()})
    if spec.image.digest:
        env.append({"name": "MUSE_STACK_IMAGE_DIGEST", "value": spec.image.digest})
    for k, v in spec.env.items():
        quoting.env_name(k, f"env.{k}")
        ref = ENV_REFERENCE.fullmatch(v)
        if ref:  # ${env:NAME}: a key of the Kubernetes secret, never a value in the manifest
            env.append({"name": k, "valueFrom": {"secretKeyRef": {"name": secret, "key": ref.group(1)}}})
        else:
            env.append({"name": k, "value": _k8s_value(v)})
    return env


def _command(spec: LaunchSpec, service: str, job: str) -> list[str]:
    recipe = f"{RECIPE_MOUNT}/recipe.yaml" if spec.recipe_text is not None else None
    run_dir = "$MUSE_STACK_RUN_DIR"  # the pod's variable, expanded by its shell
    words = [shlex.quote(w) for w in
             spec.node_command(str(spec.nodes), f"{service}:{RDZV_PORT}", job, run_dir, recipe, spec.pretrained)]
    words[len(words) - words[::-1].index("--out")] = f'"{run_dir}"'  # the word after the last --out: the run's own
    script = (
        (f'export LD_LIBRARY_PATH="{spec.library_path}${{LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}}"; '
         if spec.library_path else "") +
        "exec muse-stack-entrypoint " + " ".join(words)
    )
    return ["/bin/sh", "-c", script]


def pull_policy(spec: LaunchSpec) -> str:
    """A digest names one image for good: a node's copy is that image (IfNotPresent). A tag can be
    moved to another image: every pod start asks the registry (Always), so no node runs a stale
    copy beside nodes that pulled the new one."""
    return "IfNotPresent" if spec.image.digest else "Always"


TAG_NOTE = ("the image is given by tag, and a tag can move to another image: pods pull it at every start "
            "(imagePullPolicy: Always) so no node runs a stale copy; pass --image REGISTRY/NAME@sha256:DIGEST "
            "to pin it")


def _pod(spec: LaunchSpec, names: dict[str, str], claim: str, head: bool, secret: str) -> dict[str, Any]:
    resources = {"nvidia.com/gpu": str(spec.per_node)}
    if spec.fabric == "efa" and spec.target.efa_devices:
        resources["vpc.amazonaws.com/efa"] = str(spec.target.efa_devices)
    labels = {"app.kubernetes.io/name": "muse-stack", "muse-stack.dev/recipe": spec.recipe.name,
              RUN_LABEL: spec.run_name}
    if head:
        labels[HEAD_LABEL] = names["job"]
    container: dict[str, Any] = {
        "name": "pytorch",
        "image": spec.image.oci(),
        "imagePullPolicy": pull_policy(spec),
        "command": _command(spec, names["service"], names["job"]),
        "env": _env(spec, secret),
        "ports": [{"name": "c10d", "containerPort": RDZV_PORT, "protocol": "TCP"}],
        "resources": {"requests": dict(resources), "limits": dict(resources)},
        "volumeMounts": [
            {"name": "shared", "mountPath": DATA_MOUNT, "subPath": "data"},
            {"name": "shared", "mountPath": CHECKPOINT_MOUNT, "subPath": "checkpoints"},
            {"name": "shared", "mountPath": RUNS_MOUNT, "subPath": "runs"},
            {"name": "dshm", "mountPath": "/dev/shm"},
        ],
    }
    volumes: list[dict[str, Any]] = [
        {"name": "shared", "persistentVolumeClaim": {"claimName": claim}},
        {"name": "dshm", "emptyDir": {"medium": "Memory"}},
    ]
    if spec.recipe_text is not None:
        container["volumeMounts"].append({"name": "recipe", "mountPath": RECIPE_MOUNT, "readOnly": True})
        volumes.append({"name": "recipe", "configMap": {"name": names["recipe"]}})
    if spec.fabric == "ib":  # RDMA registers (pins) memory
        container["securityContext"] = {"capabilities": {"add": ["IPC_LOCK"]}}
    pod: dict[str, Any] = {
        "terminationGracePeriodSeconds": spec.signal_s,
        "containers": [container],
        "volumes": volumes,
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
    }
    if spec.target.gpu_product:
        pod["nodeSelector"] = {"nvidia.com/gpu.product": spec.target.gpu_product}
    if spec.target.imex:
        container["resources"]["claims"] = [{"name": IMEX_CLAIM}]
        pod["resourceClaims"] = [{"name": IMEX_CLAIM, "resourceClaimTemplateName": names["channel"]}]
    return {"metadata": {"labels": labels}, "spec": pod}


def manifests(spec: LaunchSpec, *, namespace: str | None = None, claim: str = "muse-stack-shared",
              secret: str = ENV_SECRET, queue: str = KUEUE_QUEUE) -> list[dict]:
    """The headless rendezvous service, a ConfigMap with a recipe given as a file, a ComputeDomain
    for GB200 (IMEX), and the PyTorchJob, as plain dicts (serialised by YAML's own dumper, never
    pasted as text)."""
    quoting.check(namespace, quoting.DNS_LABEL, "--namespace", "a DNS-1123 label: a-z, 0-9 and '-', at most 63",
                  "give an existing namespace's name")
    quoting.check(claim, quoting.DNS_SUBDOMAIN, "--volume-claim", "a DNS-1123 subdomain: a-z, 0-9, '-' and '.'",
                  "give the ReadWriteMany claim's name")
    quoting.check(secret, quoting.DNS_SUBDOMAIN, "--env-secret", "a DNS-1123 subdomain: a-z, 0-9, '-' and '.'",
                  "give the name of the Kubernetes secret holding the ${env:NAME} values")
    quoting.check(queue, quoting.DNS_SUBDOMAIN, "--queue", "a DNS-1123 subdomain: a-z, 0-9, '-' and '.'",
                  "give the name of the Kueue LocalQueue in the namespace")
    if not spec.target.container:
        raise InputError("Kubernetes launches run the GPU images; CPU recipes run on Slurm or locally",
                         field="hardware.gpu", value=spec.recipe.hardware.gpu,
                         fix="use --slurm, or `muse-stack run` / torchrun for a CPU recipe")
    if spec.image is None:
        raise UsageError("a Kubernetes cluster pulls its image from a registry", field="--image", value=None,
                         fix="pass --image REGISTRY/muse-stack@sha256:DIGEST")
    names = object_names(spec)
    meta: dict[str, Any] = {"labels": {"app.kubernetes.io/name": "muse-stack", "muse-stack.dev/recipe": spec.recipe.name,
                                       RUN_LABEL: spec.run_name}}
    if namespace:
        meta["namespace"] = namespace
    docs: list[dict] = [{
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": names["service"], **meta},
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,  # the rendezvous starts before any pod is ready
            "selector": {HEAD_LABEL: names["job"]},
            "ports": [{"name": "c10d", "port": RDZV_PORT, "targetPort": RDZV_PORT, "protocol": "TCP"}],
        },
    }]
    if spec.recipe_text is not None:
        docs.append({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": names["recipe"], **meta},
                     "data": {"recipe.yaml": spec.recipe_text}})
    if spec.target.imex:
        docs.append({"apiVersion": COMPUTE_DOMAIN_API, "kind": "ComputeDomain",
                     "metadata": {"name": names["domain"], **meta},
                     "spec": {"numNodes": spec.nodes, "channel": {"resourceClaimTemplate": {"name": names["channel"]}}}})
    replicas: dict[str, Any] = {
        "Master": {"replicas": 1, "restartPolicy": "OnFailure",
                   "template": _pod(spec, names, claim, head=True, secret=secret)},
    }
    if spec.nodes > 1:
        replicas["Worker"] = {"replicas": spec.nodes - 1, "restartPolicy": "OnFailure",
                              "template": _pod(spec, names, claim, head=False, secret=secret)}
    job_meta = {**meta, "labels": {**meta["labels"], KUEUE_LABEL: queue}}
    docs.append({
        "apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob",
        "metadata": {"name": names["job"], **job_meta},
        "spec": {
            "nprocPerNode": str(spec.per_node),
            "runPolicy": {"cleanPodPolicy": "None", "backoffLimit": 3},
            "pytorchReplicaSpecs": replicas,
        },
    })
    return docs


_MODELS = {("v1", "Service"): "V1Service", ("v1", "ConfigMap"): "V1ConfigMap",
           ("kubeflow.org/v1", "PyTorchJob"): "KubeflowOrgV1PyTorchJob"}


def _check_compute_domain(doc: dict) -> str | None:
    """NVIDIA's ComputeDomain has no published Python model: its few fields are checked here."""
    if set(doc) != {"apiVersion", "kind", "metadata", "spec"}:
        return "ComputeDomain: apiVersion, kind, metadata and spec only"
    spec = doc["spec"]
    if not isinstance(spec, dict) or set(spec) - {"numNodes", "channel"}:
        return "spec: numNodes and channel only"
    if not isinstance(spec.get("numNodes"), int) or isinstance(spec["numNodes"], bool) or spec["numNodes"] < 1:
        return "spec.numNodes: a positive int"
    template = (spec.get("channel") or {}).get("resourceClaimTemplate") or {}
    if set(spec["channel"]) != {"resourceClaimTemplate"} or set(template) != {"name"} or \
            not quoting.DNS_LABEL.fullmatch(str(template["name"])):
        return "spec.channel.resourceClaimTemplate.name: a DNS-1123 label"
    return None


_PRIMITIVES = {"str": str, "int": int, "bool": bool, "float": (int, float), "object": object, "datetime": str,
               "date": str}


def _check(data: Any, klass: str, path: str) -> str | None:
    """Where ``data`` breaks the declared types of the API model ``klass`` (field names and value types)."""
    import re as _re

    import kubeflow.training.models as models

    if klass.startswith("list["):
        if not isinstance(data, list):
            return f"{path}: a list"
        inner = _re.match(r"list\[(.*)\]", klass).group(1)
        return next((e for i, x in enumerate(data) if (e := _check(x, inner, f"{path}[{i}]"))), None)
    if klass.startswith("dict("):
        if not isinstance(data, dict):
            return f"{path}: a mapping"
        inner = _re.match(r"dict\(([^,]*), (.*)\)", klass).group(2)
        return next((e for k, x in data.items() if (e := _check(x, inner, f"{path}.{k}"))), None)
    if klass in _PRIMITIVES:
        want = _PRIMITIVES[klass]
        ok = isinstance(data, want) and not (klass in ("int", "float") and isinstance(data, bool))
        return None if ok else f"{path}: {klass}, not {type(data).__name__}"
    model = getattr(models, klass)
    if not isinstance(data, dict):
        return f"{path}: a {klass} mapping"
    fields = {json_key: attr for attr, json_key in model.attribute_map.items()}
    for key, value in data.items():
        where = f"{path}.{key}" if path else key
        if key not in fields:
            return f"{where}: not a field of {klass}"
        err = _check(value, model.openapi_types[fields[key]], where)
        if err:
            return err
    return None


def validate(docs: list[dict]) -> None:
    """Check each manifest against its published API model (the Kubernetes client's V1Service, the
    Kubeflow SDK's PyTorchJob with the client's pod templates): deserialising it through the SDK's
    ApiClient fails on a missing required field, and walking the models' declared field types
    fails on a field the API does not know or a value of the wrong type."""
    try:
        from kubeflow.training.api_client import ApiClient
    except ImportError as exc:
        raise InputError("the Kubernetes API models are not installed", field="--k8s", value="kubeflow-training",
                         fix="pip install kubeflow-training (a muse-stack dependency)") from exc

    client = ApiClient()
    for doc in docs:
        key = (doc.get("apiVersion"), doc.get("kind"))
        if key == (COMPUTE_DOMAIN_API, "ComputeDomain"):
            where = _check_compute_domain(doc)
            if where is not None:
                raise InputError(f"the ComputeDomain manifest is not valid: {where}", field="ComputeDomain",
                                 value=doc.get("metadata", {}).get("name"), fix="correct the manifest")
            continue
        if key not in _MODELS:
            raise InputError("no API model for this manifest", field="kind", value=f"{key[0]}/{key[1]}",
                             fix=f"manifests of kinds {sorted(_MODELS)}")
        try:
            obj = client._ApiClient__deserialize(doc, _MODELS[key])
        except (ValueError, TypeError) as exc:
            raise InputError(f"the {key[1]} manifest is not valid: {exc}", field=key[1], value=doc["metadata"]["name"],
                             fix="correct the manifest") from exc
        del obj
        where = _check(doc, _MODELS[key], "")
        if where is not None:
            raise InputError(f"the {key[1]} manifest does not match the API model: {where}",
                             field=f"{key[1]}.{where.split(':')[0]}", value=doc["metadata"]["name"],
                             fix="correct the field's name or type")


def render(spec: LaunchSpec, *, namespace: str | None = None, claim: str = "muse-stack-shared",
           secret: str = ENV_SECRET, queue: str = KUEUE_QUEUE) -> str:
    docs = manifests(spec, namespace=namespace, claim=claim, secret=secret, queue=queue)
    validate(docs)
    c = quoting.comment
    header = (f"# muse-stack launch {c(spec.recipe.name)} --k8s: {spec.nodes} node{'s' if spec.nodes > 1 else ''} x "
              f"{spec.per_node} GPUs = {spec.world_size} GPUs; run {c(spec.run_name)}\n# Network: {c(spec.network)}\n"
              f"# Needs the Kubeflow training operator (PyTorchJob), Kueue with a LocalQueue {queue!r} (gang\n"
              f"# admission: every pod of the job or none), the NVIDIA device plugin"
              + (", the EFA device plugin" if spec.fabric == "efa" else
                 ", an RDMA device plugin (add its resource to the pods)" if spec.fabric == "ib" else "")
              + (",\n# NVIDIA's DRA driver for GPUs (ComputeDomain: IMEX channels in one NVLink domain)"
                 if spec.target.imex else "")
              + f",\n# and a ReadWriteMany volume claim {claim!r} (subfolders data/, checkpoints/, runs/). "
                "Apply with kubectl apply -f.\n"
              "# Every pod start (first, restart, job restart) runs `muse-stack run ... --resume auto`: it continues\n"
              "# from the run directory's latest checkpoint, or starts the run.\n"
              + ("" if spec.image.digest else
                 "".join(f"# {line}\n" for line in textwrap.wrap(f"Image: {TAG_NOTE}.", 100))))
    return header + yaml.safe_dump_all(docs, sort_keys=False, width=120, default_flow_style=False)
