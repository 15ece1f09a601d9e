"""The architecture holds: one home per rule, the documented layout made from the tree, and the CLI
loading only what a command needs. Pure checks, except the one that runs `tasklease list`."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import tomllib
from pathlib import Path

from conftest import ROOT, Cluster
from tasklease import agent
from tasklease.api import errors
from tasklease_dev import layout

PACKAGE = ROOT / "operator" / "tasklease"
_WRITES = {"create", "replace", "delete", "merge_patch"}


def test_the_documented_layout_is_generated_from_the_tree() -> None:
    doc = (ROOT / "docs" / "development.md").read_text()
    assert f"{layout.BEGIN}\n{layout.render()}\n{layout.END}" in doc, "docs/development.md is stale: make generate"


def test_every_package_is_a_layer_of_the_import_contracts() -> None:
    packages = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    layers = next(c["layers"] for c in contracts if c["type"] == "layers")
    assert packages == set(layout.LAYERS) == {name.strip() for layer in layers for name in layer.split("|")}


def test_the_documented_exit_code_table_is_the_one_in_errors() -> None:
    table = "\n".join(f"| {code} | {meaning} |" for code, meaning in errors.exit_codes())
    assert table in (ROOT / "docs" / "shell-agents.md").read_text()


def test_only_the_protocol_writes_leases() -> None:
    """Outside `tasklease.protocol` no code passes LEASES to a writing call. (tools/tasklease_dev
    is not tasklease: its benchmark baselines measure raw Lease writes on purpose.)"""
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        if path.parent.name == "protocol":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _WRITES
                    and any(isinstance(a, ast.Name) and a.id == "LEASES" for a in node.args)):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert offenders == []


def test_the_agent_package_exports_what_users_import() -> None:
    assert {"Agent", "ClaimedTask", "Identity", "LostLease", "NothingToClaim", "TaskleaseError"} <= set(agent.__all__)
    for name in agent.__all__:
        assert getattr(agent, name).__module__.startswith("tasklease.")


def test_help_and_list_do_not_load_the_operator(cluster: Cluster, namespace: str, tmp_path: Path) -> None:
    probe = (
        "import sys\n"
        "from tasklease.cli import main\n"
        "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
        "code = main(['list'])\n"
        "heavy = ('kopf', 'prometheus_client', 'tasklease.operator.controller')\n"
        "loaded = sorted(m for m in heavy if m in sys.modules)\n"
        "print('loaded:', loaded, 'exit:', code, file=sys.stderr)\n"
    )
    config = cluster.namespaced_kubeconfig(namespace, tmp_path)
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60,
                            env={**os.environ, "KUBECONFIG": str(config)})
    assert "loaded: [] exit: 0" in result.stderr, result.stderr


def test_a_module_run_as_a_script_defines_everything_before_it_runs() -> None:
    """`python -m tasklease_dev.chaos` once called main() above a helper it needed: a
    NameError the tests, which import the module, could never see."""
    late = []
    for path in sorted([*PACKAGE.rglob("*.py"), *(ROOT / "tools").rglob("*.py")]):
        body = ast.parse(path.read_text()).body
        for i, node in enumerate(body):
            if isinstance(node, ast.If) and "__main__" in ast.unparse(node.test) and i != len(body) - 1:
                late.append(str(path.relative_to(ROOT)))
    assert late == []


def test_make_unit_runs_every_file_that_has_unit_tests() -> None:
    # `make unit` names its files (UNIT_TESTS): a file left out runs only beside a control plane,
    # and a file named there without unit tests runs nothing.
    text = (ROOT / "Makefile").read_text().replace("\\\n", " ")
    listed = set(next(line for line in text.splitlines() if line.startswith("UNIT_TESTS :=")).split(":=")[1].split())
    marked = {f"tests/{path.name}" for path in sorted((ROOT / "tests").glob("test_*.py"))
              if path != Path(__file__) and "pytest.mark.unit" in path.read_text()}
    assert listed == marked, f"only in UNIT_TESTS: {sorted(listed - marked)}; not in it: {sorted(marked - listed)}"
