"""Kubernetes manifests: a Kubeflow PyTorchJob (one pod per node running torchrun) and a headless
service that gives the first pod a stable name for the c10d rendezvous.

Why a PyTorchJob rather than a JobSet: the Kubeflow training SDK on PyPI (kubeflow-training)
publishes API models for the whole resource, pod templates included (the Kubernetes client's),
so every manifest is checked field by field against published models here; JobSet has no
published Python models, and its envelope could only be checked against a schema written by
hand. The training operator also restarts failed pods, and an interrupted run continues from its
checkpoint in the shared run directory.
"""

from __future__ import annotations

import re
import shlex
from typing import Any

import yaml

from muse_stack.errors import InputError
from muse_stack.launch import quoting
from muse_stack.launch.spec import (CHECKPOINT_MOUNT, CONTAINER_ENV, DATA_MOUNT, RDZV_PORT, RUNS_MOUNT,
                                    STOP_SIGNAL_SECONDS, LaunchSpec)
from muse_stack.recipes.schema import ENV_REFERENCE

HEAD_LABEL = "muse-stack.dev/rendezvous-head"
#: the Kubernetes secret whose keys a recipe's ${env:NAME} references name (--env-secret)
ENV_SECRET = "muse-stack-env"


def _k8s_value(value: str) -> str:
    """Shell-style $VAR / ${VAR} references as Kubernetes' $(VAR) dependent variables."""
    return re.sub(r"\$\{([A-Za-z_]\w*)\}|\$([A-Za-z_]\w*)", lambda m: f"$({m.group(1) or m.group(2)})", value)


def _env(spec: LaunchSpec, run_name: str, secret: str) -> list[dict[str, Any]]:
    env: list[dict[str, Any]] = [{"name": k, "value": v} for k, v in CONTAINER_ENV.items()]
    env.append({"name": "MUSE_STACK_RUN_DIR", "value": f"{RUNS_MOUNT}/{run_name}"})
    digest = spec.image.split("@", 1)[1] if spec.image and "@" in spec.image else None
    if digest and quoting.DIGEST.fullmatch(digest):
        env.append({"name": "MUSE_STACK_IMAGE_DIGEST", "value": digest})
    for k, v in spec.env.items():
        quoting.env_name(k, f"env.{k}")
        ref = ENV_REFERENCE.fullmatch(v)
        if ref:  # ${env:NAME}: a key of the Kubernetes secret, never a value in the manifest
            env.append({"name": k, "valueFrom": {"secretKeyRef": {"name": secret, "key": ref.group(1)}}})
        else:
            env.append({"name": k, "value": _k8s_value(v)})
    return env


def _command(spec: LaunchSpec, service: str, job: str) -> list[str]:
    run_args = " ".join(shlex.quote(a) for a in spec.run_command_args())
    script = (
        (f'export LD_LIBRARY_PATH="{spec.library_path}${{LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}}"; '
         if spec.library_path else "") +
        'if grep -qs \'"status": *"interrupted"\' "$MUSE_STACK_RUN_DIR/results.json"; '
        'then set -- --resume "$MUSE_STACK_RUN_DIR"; '
        f'else set -- {run_args} --out "$MUSE_STACK_RUN_DIR"; fi; '
        "exec muse-stack-entrypoint python -m torch.distributed.run "
        f"--nnodes={spec.nodes} --nproc-per-node={spec.per_node} "
        f"--rdzv-backend=c10d --rdzv-endpoint={service}:{RDZV_PORT} --rdzv-id={job} "
        '--module muse_stack.cli run "$@" --no-progress'
    )
    return ["/bin/sh", "-c", script]


def _pod(spec: LaunchSpec, service: str, job: str, run_name: str, claim: str, head: bool,
         secret: str) -> dict[str, Any]:
    resources = {"nvidia.com/gpu": str(spec.per_node)}
    if spec.env and spec.target.efa_devices:
        resources["vpc.amazonaws.com/efa"] = str(spec.target.efa_devices)
    labels = {"app.kubernetes.io/name": "muse-stack", "muse-stack.dev/recipe": spec.recipe.name}
    if head:
        labels[HEAD_LABEL] = job
    return {
        "metadata": {"labels": labels},
        "spec": {
            "terminationGracePeriodSeconds": STOP_SIGNAL_SECONDS,
            "containers": [{
                "name": "pytorch",
                "image": spec.image,
                "imagePullPolicy": "IfNotPresent",
                "command": _command(spec, service, job),
                "env": _env(spec, run_name, secret),
                "ports": [{"name": "c10d", "containerPort": RDZV_PORT, "protocol": "TCP"}],
                "resources": {"requests": dict(resources), "limits": dict(resources)},
                "volumeMounts": [
                    {"name": "shared", "mountPath": DATA_MOUNT, "subPath": "data"},
                    {"name": "shared", "mountPath": CHECKPOINT_MOUNT, "subPath": "checkpoints"},
                    {"name": "shared", "mountPath": RUNS_MOUNT, "subPath": "runs"},
                    {"name": "dshm", "mountPath": "/dev/shm"},
                ],
            }],
            "volumes": [
                {"name": "shared", "persistentVolumeClaim": {"claimName": claim}},
                {"name": "dshm", "emptyDir": {"medium": "Memory"}},
            ],
        },
    }


def manifests(spec: LaunchSpec, *, namespace: str | None = None, claim: str = "muse-stack-shared",
              secret: str = ENV_SECRET) -> list[dict]:
    """The headless rendezvous service and the PyTorchJob, as plain dicts (serialised by YAML's own
    dumper, never pasted as text)."""
    quoting.check(namespace, quoting.DNS_LABEL, "--namespace", "a DNS-1123 label: a-z, 0-9 and '-', at most 63",
                  "give an existing namespace's name")
    quoting.check(claim, quoting.DNS_SUBDOMAIN, "--volume-claim", "a DNS-1123 subdomain: a-z, 0-9, '-' and '.'",
                  "give the ReadWriteMany claim's name")
    quoting.check(secret, quoting.DNS_SUBDOMAIN, "--env-secret", "a DNS-1123 subdomain: a-z, 0-9, '-' and '.'",
                  "give the name of the Kubernetes secret holding the ${env:NAME} values")
    if not spec.target.container:
        raise InputError("Kubernetes launches run the GPU images; CPU recipes run on Slurm or locally",
                         field="hardware.gpu", value=spec.recipe.hardware.gpu,
                         fix="use --slurm, or `muse-stack run` / torchrun for a CPU recipe")
    job = spec.run_name or spec.job_name
    run_name = spec.run_name or job
    service = f"{job}-rdzv"
    meta: dict[str, Any] = {"labels": {"app.kubernetes.io/name": "muse-stack", "muse-stack.dev/recipe": spec.recipe.name}}
    if namespace:
        meta["namespace"] = namespace
    svc = {
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": service, **meta},
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,  # the rendezvous starts before any pod is ready
            "selector": {HEAD_LABEL: job},
            "ports": [{"name": "c10d", "port": RDZV_PORT, "targetPort": RDZV_PORT, "protocol": "TCP"}],
        },
    }
    replicas: dict[str, Any] = {
        "Master": {"replicas": 1, "restartPolicy": "OnFailure",
                   "template": _pod(spec, service, job, run_name, claim, head=True, secret=secret)},
    }
    if spec.nodes > 1:
        replicas["Worker"] = {"replicas": spec.nodes - 1, "restartPolicy": "OnFailure",
                              "template": _pod(spec, service, job, run_name, claim, head=False, secret=secret)}
    pytorchjob = {
        "apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob",
        "metadata": {"name": job, **meta},
        "spec": {
            "nprocPerNode": str(spec.per_node),
            "runPolicy": {"cleanPodPolicy": "None", "backoffLimit": 3},
            "pytorchReplicaSpecs": replicas,
        },
    }
    return [svc, pytorchjob]


_MODELS = {("v1", "Service"): "V1Service", ("kubeflow.org/v1", "PyTorchJob"): "KubeflowOrgV1PyTorchJob"}


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
           secret: str = ENV_SECRET) -> str:
    docs = manifests(spec, namespace=namespace, claim=claim, secret=secret)
    validate(docs)
    c = quoting.comment
    header = (f"# muse-stack launch {c(spec.recipe.name)} --k8s: {spec.nodes} node{'s' if spec.nodes > 1 else ''} x "
              f"{spec.per_node} GPUs = {spec.world_size} GPUs\n# Network: {c(spec.network)}\n"
              f"# Needs the Kubeflow training operator (PyTorchJob), the NVIDIA and EFA device plugins, and a\n"
              f"# ReadWriteMany volume claim {claim!r} (subfolders data/, checkpoints/, runs/). Apply with kubectl apply -f.\n")
    return header + yaml.safe_dump_all(docs, sort_keys=False, width=120, default_flow_style=False)
