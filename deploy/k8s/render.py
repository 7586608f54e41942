"""Writes deploy/k8s/*.yaml: the Helm chart deploy/helm/kvguard rendered by Helm itself (the
`helm-python-sdk` wheel embeds it) with deploy/k8s/values.yaml, for clusters deployed with
kubectl. tests/test_deploy.py fails when the files differ from a fresh rendering.

    .venv/bin/python deploy/k8s/render.py           # rewrite the files
    .venv/bin/python deploy/k8s/render.py --check   # exit 1 if they are stale
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
CHART = HERE.parent / "helm" / "kvguard"
RELEASE, NAMESPACE = "llm-inference", "default"
# each file: what it holds, and the chart's templates that go into it, applied in this order
FILES = {
    "kvguard-db-upgrade.yaml": ("The schema migration Job: apply it first and wait for it to complete "
                                "(docs/operations.md).", ["migration-job.yaml"]),
    "inference-with-kvguard.yaml": ("The volume of the key-encryption keys, the inference Deployment with "
                                    "kvguard as its native sidecar, and the Service of the sidecars' metrics.",
                                    ["kek-pvc.yaml", "deployment.yaml", "service.yaml"]),
}
HEADER = ("# Rendered by `python deploy/k8s/render.py` from the Helm chart deploy/helm/kvguard with\n"
          "# deploy/k8s/values.yaml (release {release}); do not edit: change the chart and render again.\n# {what}\n")


def render(release: str = RELEASE, namespace: str = NAMESPACE) -> dict[str, str]:
    """The manifests' texts by file name."""
    import helm_python as helm

    values = yaml.safe_load((HERE / "values.yaml").read_text())
    with helm.Chart.load(CHART) as chart:
        rendered = chart.render(values, name=release, namespace=namespace, is_install=True)
    out = {}
    for name, (what, templates) in FILES.items():
        parts = [rendered[f"kvguard/templates/{t}"].strip() for t in templates]
        out[name] = HEADER.format(release=release, what=what) + "---\n" + "\n---\n".join(parts) + "\n"
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="only say whether the files are current (exit 1 if not)")
    args = parser.parse_args(argv)
    stale = []
    for name, text in render().items():
        path = HERE / name
        if path.exists() and path.read_text() == text:
            continue
        stale.append(name)
        if not args.check:
            path.write_text(text)
    if args.check and stale:
        print("stale: " + ", ".join(stale) + " (run python deploy/k8s/render.py)", file=sys.stderr)
        return 1
    print(("rewrote " + ", ".join(stale)) if stale else "the manifests are current")
    return 0


if __name__ == "__main__":
    sys.exit(main())
