"""Types shared by the router, the operator and the tools."""

from typing import Any

Json = dict[str, Any]  # a JSON object (a request body, a Kubernetes object) as plain data
