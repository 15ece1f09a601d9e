"""The operator: status, expiry, requeue, dead letters, Events, metrics, one leader.

It keeps Task.status true, expires silent holders, requeues with backoff and
dead-letters tasks that keep failing.

Rule: reacts to watch events and writes only through `tasklease.protocol` (Leases) and
the status subresource; never imports `tasklease.agent`. `controller` is the kopf wiring.
"""
