"""The `k8s` profile: steps as Kubernetes Jobs with the pod spec of their pool, training
as GPU pods launched through Dagster Pipes (PipesK8sClient).

No cluster runs here: `render_jobs` builds the Job and Pod specs with dagster-k8s's own
constructors (as its launcher and executor do) so that they can be reviewed, applied by
hand and snapshot-tested (tests/scale_out/test_k8s.py).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import dagster as dg
import yaml

IMAGE_ENV = "RSTAR_IMAGE"
NAMESPACE_ENV = "RSTAR_K8S_NAMESPACE"
TEMPLATE = Path(__file__).parent / "templates" / "k8s.yaml"

# dagster-k8s user-defined config (container_config / pod_spec_config) per pool.
# `llm` steps send prompts to vLLM servers (RSTAR_LLM_BASE_URL) and `sandbox` steps send
# programs to sandbox services (RSTAR_SANDBOX_URLS): both mostly wait on the network.
# Every `gpu` step is a training stage: its step pod only launches and watches the
# training pod (TRAINING_POD), which is the one that asks for the GPU.
POOL_K8S_CONFIG: dict[str | None, dict[str, Any]] = {
    None: {"container_config": {"resources": {"requests": {"cpu": "1", "memory": "2Gi"}}}},
    "llm": {"container_config": {"resources": {"requests": {"cpu": "1", "memory": "4Gi"}}}},
    "sandbox": {
        "container_config": {
            "resources": {"requests": {"cpu": "2", "memory": "4Gi"}, "limits": {"memory": "8Gi"}}
        }
    },
    "gpu": {"container_config": {"resources": {"requests": {"cpu": "500m", "memory": "1Gi"}}}},
}
TRAINING_POD: dict[str, Any] = {
    "resources": {
        "requests": {"cpu": "8", "memory": "64Gi", "nvidia.com/gpu": "1"},
        "limits": {"nvidia.com/gpu": "1", "memory": "96Gi"},
    },
    "nodeSelector": {"nvidia.com/gpu.present": "true"},
    "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
}


def pool_config(pool: str | None) -> dict[str, Any]:
    if pool not in POOL_K8S_CONFIG:
        raise ValueError(
            f"pool {pool!r} (pipeline.yaml) has no pod spec in the k8s profile: "
            f"add it to POOL_K8S_CONFIG ({', '.join(p for p in POOL_K8S_CONFIG if p)})"
        )
    return POOL_K8S_CONFIG[pool]


def per_step_config(pools: Mapping[str, str | None]) -> dict[str, dict[str, Any]]:
    """k8s_job_executor's per_step_k8s_config: every declared asset's op (named like
    its key) gets the pod spec of its pool."""
    return {key: pool_config(pool) for key, pool in pools.items()}


def step_executor(pools: Mapping[str, str | None]) -> dg.ExecutorDefinition:
    from dagster_k8s import k8s_job_executor

    return k8s_job_executor.configured(
        {
            "job_image": {"env": IMAGE_ENV},
            "job_namespace": {"env": NAMESPACE_ENV},
            "step_k8s_config": pool_config(None),
            "per_step_k8s_config": per_step_config(pools),
        },
        name="k8s",
    )


def _launcher_config() -> dict[str, Any]:
    return yaml.safe_load(TEMPLATE.read_text())["run_launcher"]["config"]


def training_pod_spec(image: str) -> dict[str, Any]:
    """The base pod spec of a training pod: one GPU on a GPU node, the data volume and
    the profile's settings (Pipes adds its own environment to the first container)."""
    launcher = _launcher_config()
    return {
        "nodeSelector": TRAINING_POD["nodeSelector"],
        "tolerations": TRAINING_POD["tolerations"],
        "serviceAccountName": launcher["service_account_name"],
        "containers": [
            {
                "name": "train",
                "image": image,
                "resources": TRAINING_POD["resources"],
                "env": [
                    {"name": name, "value": value}
                    for name, value in (v.split("=", 1) for v in launcher["env_vars"])
                ],
                "envFrom": [{"secretRef": {"name": s}} for s in launcher["env_secrets"]]
                + [{"configMapRef": {"name": c}} for c in launcher["env_config_maps"]],
                "volumeMounts": launcher["volume_mounts"],
            }
        ],
        "volumes": launcher["volumes"],
    }


def run_training_pod(context: dg.AssetExecutionContext, command: list[str]) -> None:
    from dagster_k8s import PipesK8sClient

    image = os.environ[IMAGE_ENV]
    PipesK8sClient().run(
        context=context,
        image=image,
        command=command,
        namespace=os.environ.get(NAMESPACE_ENV),
        base_pod_spec=training_pod_spec(image),
    )


def render_jobs(pools: Mapping[str, str | None], image: str, namespace: str) -> dict[str, Any]:
    """The Kubernetes objects the profile creates, as plain dicts: the run worker Job,
    one step Job per pool of `pools` (asset key -> pool; for its first asset), and a
    training pod."""
    import kubernetes
    from dagster_k8s.job import DagsterK8sJobConfig, construct_dagster_k8s_job

    launcher = _launcher_config()
    base = _container_context(launcher, namespace)
    # As K8sContainerContext.get_k8s_job_config: the rest is in run_k8s_config.
    job_config = DagsterK8sJobConfig(
        job_image=image,
        dagster_home=launcher["dagster_home"],
        instance_config_map=launcher["instance_config_map"],
    )
    serialize = kubernetes.client.ApiClient().sanitize_for_serialization
    rendered: dict[str, Any] = {
        "run_worker": serialize(
            construct_dagster_k8s_job(
                job_config,
                args=["dagster", "api", "execute_run", "<serialized run args>"],
                job_name="dagster-run-<run id>",
                component="run_worker",
                user_defined_k8s_config=base.run_k8s_config,
                labels={"dagster/job": "__ASSET_JOB", "dagster/run-id": "<run id>"},
            )
        )
    }
    for name, job in _step_jobs(pools, base, job_config).items():
        rendered[name] = serialize(job)
    rendered["training_pod"] = serialize(_training_pod_body(image))
    return rendered


def _container_context(launcher: dict[str, Any], namespace: str) -> Any:
    """The run launcher's container settings (the template's), in `namespace`."""
    from dagster_k8s.container_context import K8sContainerContext
    from dagster_k8s.job import UserDefinedDagsterK8sConfig

    return K8sContainerContext(
        image_pull_policy=launcher["image_pull_policy"],
        service_account_name=launcher["service_account_name"],
        env_config_maps=launcher["env_config_maps"],
        env_secrets=launcher["env_secrets"],
        env_vars=launcher["env_vars"],
        volume_mounts=launcher["volume_mounts"],
        volumes=launcher["volumes"],
        namespace=namespace,
        run_k8s_config=UserDefinedDagsterK8sConfig.from_dict(launcher["run_k8s_config"]),
    )


def _step_jobs(pools: Mapping[str, str | None], base: Any, job_config: Any) -> dict[str, Any]:
    """One step Job per pool, for the first asset of that pool, by pool name."""
    from dagster_k8s.container_context import K8sContainerContext
    from dagster_k8s.job import UserDefinedDagsterK8sConfig, construct_dagster_k8s_job

    firsts: dict[str | None, str] = {}
    for key, pool in pools.items():
        firsts.setdefault(pool, key)
    jobs = {}
    for pool, key in sorted(firsts.items(), key=lambda item: item[0] or ""):
        step = base.merge(
            K8sContainerContext(
                run_k8s_config=UserDefinedDagsterK8sConfig.from_dict(pool_config(pool))
            )
        )
        jobs[f"step:{pool or 'default'}"] = construct_dagster_k8s_job(
            job_config,
            args=["dagster", "api", "execute_step", "<serialized step args>"],
            job_name=f"dagster-step-{key.replace('_', '-')}",
            component="step_worker",
            user_defined_k8s_config=step.run_k8s_config,
            labels={"dagster/op": key, "dagster/run-id": "<run id>"},
        )
    return jobs


def _training_pod_body(image: str) -> Any:
    """The pod a training step runs in through Dagster Pipes."""
    from dagster_k8s.pipes import build_pod_body

    return build_pod_body(
        pod_name="dagster-pipes-<run id>-<asset>",
        image=image,
        command=["python", "-m", "rstar_pipelines.training.launch", "<train_config.json>"],
        env_vars={"DAGSTER_PIPES_CONTEXT": "<injected>", "DAGSTER_PIPES_MESSAGES": "<...>"},
        base_pod_meta=None,
        base_pod_spec=training_pod_spec(image),
    )
