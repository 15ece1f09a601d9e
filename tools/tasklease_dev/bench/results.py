"""Result files: one dated JSON file per run in bench/results/: machine, commit, date and every figure.
"""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path
from typing import Any

from tasklease_dev.dist import revision

ROOT = Path(__file__).resolve().parents[3]
RESULTS = ROOT / "bench" / "results"
Results = dict[str, Any]


def machine() -> Results:
    model = ""
    try:
        model = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                     if line.startswith("model name"))
    except (OSError, StopIteration):
        model = platform.processor()
    return {"nproc": os.cpu_count(), "cpu_model": model, "loadavg_at_start": os.getloadavg()[0]}


def new(root: Path, **facts: Any) -> tuple[Results, Path]:
    """A run's results, its facts filled in, and the file it goes to ($BENCH_OUT, or
    bench/results/<date>-<commit>.json)."""
    res: Results = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "commit": revision(root, short=True),
                    "machine": machine(), **facts}
    stamp = res["date"][:16].replace(":", "")
    out = Path(os.environ.get("BENCH_OUT") or RESULTS / f"{stamp}-{res['commit']}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    return res, out


def write(res: Results, out: Path) -> None:
    out.write_text(json.dumps(res, indent=2, default=str) + "\n")


def load(folder: Path = RESULTS) -> list[tuple[str, Results]]:
    """Every result file, newest first, as (file name, results)."""
    found = [(path.name, json.loads(path.read_text())) for path in folder.glob("*.json")]
    return sorted(found, key=lambda item: (str(item[1].get("date", "")), item[0]), reverse=True)


def newest_with(key: str, folder: Path = RESULTS) -> tuple[str, Results] | None:
    """The newest result file that measured `key`."""
    return next(((name, res) for name, res in load(folder) if res.get(key) is not None), None)
