"""What the Kubernetes tests share: deploy/kubernetes rendered by kubectl kustomize, and each object validated
against its schema (kubernetes-validate for core kinds, the CRD models for the Prometheus Operator and KEDA)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy" / "kubernetes"
KUBERNETES_VERSION = "1.32.0"
kubectl = shutil.which("kubectl")


class _Loader(yaml.SafeLoader):
    """kubectl writes `matchType: =` unquoted; YAML 1.1's `=` (value) tag is just that string here."""


_Loader.add_constructor("tag:yaml.org,2002:value", lambda loader, node: loader.construct_scalar(node))


def render(path: str) -> list[dict[str, Any]]:
    out = subprocess.run([kubectl, "kustomize", str(DEPLOY / path)], check=True, capture_output=True, text=True)
    return [doc for doc in yaml.load_all(out.stdout, Loader=_Loader) if doc]


def crd_model(obj: dict[str, Any]):
    from cloudcoil.models.keda import v1alpha1 as keda
    from cloudcoil.models.prometheus_operator import v1 as monitoring
    from cloudcoil.models.prometheus_operator import v1alpha1 as monitoring_alpha

    return {("monitoring.coreos.com/v1", "PrometheusRule"): monitoring.PrometheusRule,
            ("monitoring.coreos.com/v1", "ServiceMonitor"): monitoring.ServiceMonitor,
            ("monitoring.coreos.com/v1", "PodMonitor"): monitoring.PodMonitor,
            ("monitoring.coreos.com/v1alpha1", "AlertmanagerConfig"): monitoring_alpha.AlertmanagerConfig,
            ("keda.sh/v1alpha1", "ScaledObject"): keda.ScaledObject}.get((obj["apiVersion"], obj["kind"]))


def validate(obj: dict[str, Any]) -> None:
    """Raise when ``obj`` does not fit its schema: core kinds by kubernetes-validate (strict: unknown fields
    fail), CRD kinds by parsing into the CRD's model and requiring that nothing was dropped (the models ignore
    unknown fields, so a round trip that loses a field means the field is not in the CRD)."""
    model = crd_model(obj)
    if model is None:
        import kubernetes_validate

        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
        return
    parsed = model.model_validate(obj).model_dump(by_alias=True, exclude_unset=True, mode="json")
    if parsed != obj:
        raise ValueError(f"{obj['kind']} {obj['metadata']['name']}: fields outside the CRD schema")
