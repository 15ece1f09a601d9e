"""Development tools: the local control plane, the demo, the benchmarks.

The control plane is built from Go modules. Nothing here ships in an agent's or the operator's code path.

Rule: may use every layer; no layer uses it (tests do).
"""
