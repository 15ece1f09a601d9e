"""The Task API: models, the CRD and RBAC made from them, errors, timestamps.

The pydantic models are the one source of truth; the CRD schema and the chart's RBAC
are generated from them, and the errors and wire format of time are shared by all.

Rule: no I/O and no Kubernetes client here; everything above depends on this.
"""
