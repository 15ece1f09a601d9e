"""`make bench`: what tasklease costs at scale, beside floors and peers measured in the same run.

Modules, one idea each: `run` (the command and its sections), `harness` (worker processes,
cases side by side, alternating pairs), `worker` (one worker process), `space` (namespaces
and tasks), `procs` (processes, memory, metrics), the cases (`floors`, `agents_at_work`,
`recovery`, `scale`), `targets` (thresholds and the verdict table), `report` (what is
printed), `results` (the dated result files).
"""
