"""Test agent: claim one task, say so, hold it until the file GO exists, then try to finish.

    python hold.py KUBECONFIG QUEUE GO_FILE

Prints one JSON line per step, so the test can follow it: claimed, then the outcome of an
explicit renew and of a completion (ok, or the exception's class name).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from tasklease.api import errors
from tasklease.agent import Agent


def main() -> int:
    kubeconfig, queue, go = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    agent = Agent.connect(kubeconfig=kubeconfig)
    task = agent.claim(queue, timeout=60, interrupt=False)
    print(json.dumps({"claimed": task.name, "epoch": task.epoch, "holder": task.holder}), flush=True)
    while not go.exists():
        time.sleep(0.05)
    task.lost.wait(10)  # after a pause, the renew thread needs a moment to notice
    report = {"lost": task.lost.is_set(), "lost_reason": task.lost_reason}
    for step, call in (("renew", lambda: agent.protocol.renew(task.held)),
                       ("complete", lambda: agent.protocol.complete(task.held, "stale result"))):
        try:
            call()
            report[step] = "ok"
        except errors.TaskleaseError as exc:
            report[step] = type(exc).__name__
    print(json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
