"""What `make bench` prints at its end: throughput beside the floors, every pair's ratio, the verdict table.
"""

from __future__ import annotations

from typing import Any

from tasklease_dev.bench.targets import table
from tasklease_dev.bench.worker import THROUGHPUT_FLOORS

Results = dict[str, Any]


def _ms(value: float | None) -> str:
    return f"{'-':>10}" if value is None else f"{value * 1000:8.2f}ms"


def print_report(res: Results) -> list[str]:
    """Print the run's figures and its verdicts; the keys of the targets missed or not run."""
    m = res["machine"]
    print(f"\ntasklease bench: {m['cpu_model']}, {m['nproc']} CPUs (load {m['loadavg_at_start']:.1f} at start), "
          f"Kubernetes {res['kubernetes']} on 127.0.0.1, etcd {res['etcd_flags']}, "
          f"{res.get('runtime_s', 0) / 60:.0f} min{', quick' if res.get('quick') else ''}\n")
    counts = [key for key in res.get("cases", {}) if key.isdigit()]
    if counts:
        modes = (*THROUGHPUT_FLOORS, "sdk")
        print("tasks/s, and ÷ the raw floor, by agents, operator off: the floors one step nearer the SDK each")
        print(f"{'agents':>6} " + " ".join(f"{mode:>15}" for mode in modes) + f" {'claim p50':>10} {'409s':>5}")
        for n in counts:
            case = res["cases"][n]
            print(f"{n:>6} " + " ".join(f"{case[m]['rate']:8.1f} ({case[m]['rate'] / case['raw']['rate']:4.2f})"
                                        for m in modes) +
                  f" {_ms(case['sdk'].get('p50'))} {case['sdk']['conflicts']:>5}")
    for key in sorted(k for k in res if k.endswith("_pairs")):
        print(f"{key}: " + " ".join(f"{r:4.2f}" for r in res[key]) + f"  figure {res[key[:-len('_pairs')]]:.2f}")
    if "put_p50_s" in res:
        print(f"\nfloors: conditional PUT {_ms(res['put_p50_s'])}, GET + PUT {_ms(res['get_put_p50_s'])}; "
              f"peers acquiring a free Lease: Python LeaderElection {_ms(res.get('python_le_p50_s'))}, "
              f"client-go {_ms(res.get('client_go_p50_s'))}")
    print()
    lines, missed = table(res)
    print("\n".join(lines))
    return missed
