"""The typed door to the Kubernetes API, and watching.

Raw JSON in and out, HTTP statuses as exceptions, and watches that resume from their
resourceVersion.

Rule: the only package that knows the `kubernetes` client; writes are never retried here
(a 409 is an answer the protocol must see).
"""

from tasklease.kube.client import CRDS, EVENTS, JSON, LEASES, NAMESPACES, PODS, TASKQUEUES, TASKS, Kube, Resource

__all__ = ["CRDS", "EVENTS", "JSON", "LEASES", "NAMESPACES", "PODS", "TASKQUEUES", "TASKS", "Kube", "Resource"]
