"""Run ``fleetgate`` as the image does, with discovery pointed at a stand-in API server.

``python image_entry.py K8S_URL NAMESPACE -- ARGV...`` runs ``gateway.cli.main(ARGV)`` in
the interpreter it is started with (the image-equivalent environment, not the test's).
Only two things differ from a pod, because no Kubernetes API server can run here: the
Kubernetes client talks to ``K8S_URL`` (tests/integration/k8s_standin.py) instead of using
the service-account credentials, and the pod's namespace (a mounted file in a pod) is
``NAMESPACE``. The file imports nothing from tests/: that environment has no tests package.
"""

from __future__ import annotations

import sys

from kubernetes_asyncio.client import ApiClient, Configuration

import replicas.kubernetes as discovery
from gateway.cli import main


def run(argv: list[str]) -> int:
    url, namespace, separator, *args = argv
    assert separator == "--", "usage: image_entry.py K8S_URL NAMESPACE -- ARGV..."
    discovery.set_api_client_factory(lambda: ApiClient(Configuration(host=url)))
    discovery.pod_namespace = lambda path=discovery.POD_NAMESPACE_FILE: namespace  # type: ignore[assignment]
    return main(args)


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
