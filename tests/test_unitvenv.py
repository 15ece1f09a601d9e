"""`make unit-all`'s virtualenvs: what they hold, and that they are made once."""

from __future__ import annotations

from pathlib import Path

import pytest

from tasklease_dev import unitvenv

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.unit
def test_a_unit_virtualenv_holds_the_runtime_and_operator_dependencies_and_the_test_runner_alone(
        tmp_path: Path) -> None:
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text("""
[project]
name = "x"
dependencies = ["kubernetes>=31", "pydantic>=2.7"]
[project.optional-dependencies]
operator = ["kopf>=1.45"]
metrics = ["prometheus-client>=0.20"]
test = ["pytest>=8", "pytest-timeout>=2.3", "hypothesis>=6.100", "mypy>=1.10", "ruff>=0.5"]
""")
    assert unitvenv.requirements(pyproject) == ["hypothesis>=6.100", "kopf>=1.45", "kubernetes>=31",
                                                "pydantic>=2.7", "pytest-timeout>=2.3", "pytest>=8"]
    # The project's own file names every runner the unit tests need (a renamed one would be missed).
    names = {unitvenv._name(r) for r in unitvenv.requirements(ROOT / "pyproject.toml")}
    assert set(unitvenv.RUNNERS) <= names


@pytest.mark.unit
def test_a_ready_unit_virtualenv_is_used_as_it_is_and_other_requirements_get_another(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TASKLEASE_BIN_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PYENV_ROOT", str(tmp_path / "no-pyenv"))
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text('[project]\nname = "x"\ndependencies = ["pydantic>=2.7"]\n'
                         '[project.optional-dependencies]\noperator = []\ntest = ["pytest>=8"]\n')
    venv = unitvenv.location("3.99.0", unitvenv.requirements(pyproject))
    assert venv.is_relative_to(tmp_path / "cache")
    with pytest.raises(SystemExit, match="Python 3.99.0 is not installed"):  # not made yet: it needs that Python
        unitvenv.ensure("3.99.0", pyproject)
    (venv / ".ready").parent.mkdir(parents=True)
    (venv / ".ready").touch()
    assert unitvenv.ensure("3.99.0", pyproject) == venv  # made before: no Python, no pip, no lock
    pyproject.write_text(pyproject.read_text().replace("pydantic>=2.7", "pydantic>=2.8"))
    wanted = unitvenv.requirements(pyproject)
    assert unitvenv.location("3.99.0", wanted) != venv
    assert unitvenv.location("3.98.0", wanted) != unitvenv.location("3.99.0", wanted)
