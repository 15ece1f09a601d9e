"""tasklease: every unit of work has exactly one current owner, on Kubernetes.

The layers, lowest first; each imports only from those below it (`make lint` checks it):

    api       the Task resource (models, CRD, RBAC), errors, timestamps. No I/O.
    kube      the typed door to the API server, and watching.
    protocol  every Lease transition. Only this package writes Leases.
    agent     the SDK agents use: claim, renew, finish; discovery; `tasklease run`.
    operator  expiry, requeue, dead letters, status projection, leader election, kopf.
    cli       `tasklease`: parse, call, print.
    dev       the local control plane, the demo and the benchmarks.

`agent` and `operator` never import each other: agents keep working while no operator runs.
"""
