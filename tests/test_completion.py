"""`tasklease completion bash|zsh`: scripts made from the parser, driven here by a real bash."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from tasklease.cli import completion
from tasklease.cli.main import build_parser


def _script(shell: str) -> str:
    done = subprocess.run([sys.executable, "-m", "tasklease.cli", "completion", shell],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stderr == "", done.stderr
    return done.stdout


@pytest.fixture(scope="module")
def bash_script() -> str:
    return _script("bash")


def complete(script: str, *words: str) -> list[str]:
    """What bash offers for the last of `words` (the word being typed) after `tasklease`."""
    line = " ".join(f"'{w}'" for w in ("tasklease", *words))
    probe = f'{script}\nCOMP_WORDS=({line}); COMP_CWORD={len(words)}; _tasklease; printf "%s\\n" "${{COMPREPLY[@]}}"'
    done = subprocess.run(["bash", "--norc", "--noprofile", "-c", probe], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


def test_bash_completes_commands_flags_and_choices(bash_script: str) -> None:
    assert complete(bash_script, "su") == ["submit"]
    assert set(complete(bash_script, "re")) == {"renew", "release", "requeue", "resume", "retry"}
    assert complete(bash_script, "-n", "shop", "li") == ["list"]          # a global flag's value is not a command
    assert "--max-attempts" in complete(bash_script, "submit", "--")
    assert complete(bash_script, "list", "--phase", "S") == ["Succeeded"]
    assert complete(bash_script, "submit", "--backoff-policy", "") == ["Exponential", "Fixed"]
    assert complete(bash_script, "completion", "z") == ["zsh"]
    assert complete(bash_script, "run", "--queue", "q", "--", "ech") == []   # the command's own words: bash's default


def test_bash_registers_for_the_kubectl_plugin_too(bash_script: str) -> None:
    assert bash_script.rstrip().endswith("complete -o default -F _tasklease tasklease kubectl-tasklease")


def test_every_command_is_offered_by_both_shells() -> None:
    parser = build_parser()
    commands = {name for name, _ in completion._subparsers(parser).items()}
    assert {"submit", "run", "operator", "completion"} <= commands
    for shell in completion.SHELLS:
        text = _script(shell)
        assert all(f"{name})" in text for name in commands), shell


@pytest.mark.skipif(shutil.which("zsh") is None, reason="zsh is not installed here")
def test_the_zsh_script_parses() -> None:
    done = subprocess.run(["zsh", "-n"], input=_script("zsh"), capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr


def test_an_unknown_shell_is_one_line_and_exit_2() -> None:
    done = subprocess.run([sys.executable, "-m", "tasklease.cli", "completion", "fish"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "invalid choice: 'fish'" in done.stderr and "Traceback" not in done.stderr
