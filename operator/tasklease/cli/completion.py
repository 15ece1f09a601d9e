"""`tasklease completion bash|zsh`: shell completion made from the CLI's own parser.

Commands, their flags and the flags' fixed choices come from `argparse`, so a new command
or flag completes without touching this module. File-valued flags complete file names.
"""

from __future__ import annotations

import argparse
import shlex

_FILE_DESTS = {"kubeconfig", "filename", "payload_file"}


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, tuple[str, argparse.ArgumentParser]]:
    """Each command's name, its one-line help and its parser."""
    found: dict[str, tuple[str, argparse.ArgumentParser]] = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {choice.dest: choice.help or "" for choice in action._choices_actions}
            for name, sub in action.choices.items():
                found[name] = (helps.get(name, ""), sub)
    return found


def _words(parser: argparse.ArgumentParser) -> list[str]:
    """What may come next after a command: its flags, and its positional arguments' choices."""
    return [word for action in parser._actions
            for word in (action.option_strings or [str(c) for c in action.choices or ()
                                                   if not isinstance(action, argparse._SubParsersAction)])]


def _valued(parser: argparse.ArgumentParser) -> tuple[dict[str, list[str]], list[str]]:
    """Flags with fixed choices, and flags that take a file name."""
    choices: dict[str, list[str]] = {}
    files: list[str] = []
    top = {flag for action in parser._actions if action.dest == "kubeconfig" for flag in action.option_strings}
    for action in parser._actions:
        if action.choices and action.option_strings:
            for flag in action.option_strings:
                choices[flag] = [str(c) for c in action.choices]
        if action.dest in _FILE_DESTS:
            files += [flag for flag in action.option_strings if flag not in top or parser.prog == "tasklease"]
    return choices, files


def bash(parser: argparse.ArgumentParser) -> str:
    commands = _subparsers(parser)
    values, per_command = [], []
    for name, (_, sub) in commands.items():
        choices, files = _valued(sub)
        for flag, words in choices.items():
            values.append(f"        {name}:{flag}) COMPREPLY=($(compgen -W {shlex.quote(' '.join(words))} "
                          f'-- "$cur")); return ;;')
        if files:
            patterns = "|".join(f"{name}:{flag}" for flag in files)
            values.append(f'        {patterns}) COMPREPLY=($(compgen -f -- "$cur")); return ;;')
        per_command.append(f"        {name}) words={shlex.quote(' '.join(_words(sub)))} ;;")
    _, top_files = _valued(parser)
    return f"""# bash completion for tasklease: source <(tasklease completion bash)
_tasklease() {{
    local cur="${{COMP_WORDS[COMP_CWORD]}}" prev="${{COMP_WORDS[COMP_CWORD-1]}}" cmd="" words i
    local commands={shlex.quote(' '.join(commands))}
    for ((i = 1; i < COMP_CWORD; i++)); do
        [[ ${{COMP_WORDS[i]}} == -- ]] && return 0  # the command `tasklease run` runs: default completion
        if [[ -z $cmd && " $commands " == *" ${{COMP_WORDS[i]}} "* ]]; then cmd=${{COMP_WORDS[i]}}; fi
    done
    case "$cmd:$prev" in
{chr(10).join(values)}
        {'|'.join(f'*:{f}' for f in top_files)}) COMPREPLY=($(compgen -f -- "$cur")); return ;;
    esac
    case "$cmd" in
        "") words="$commands {' '.join(_words(parser))}" ;;
{chr(10).join(per_command)}
    esac
    COMPREPLY=($(compgen -W "$words" -- "$cur"))
}}
complete -o default -F _tasklease tasklease kubectl-tasklease
"""


def zsh(parser: argparse.ArgumentParser) -> str:
    commands = _subparsers(parser)
    described = " ".join(shlex.quote(f"{name}:{text}") for name, (text, _) in commands.items())
    values, per_command = [], []
    for name, (_, sub) in commands.items():
        choices, files = _valued(sub)
        for flag, words in choices.items():
            values.append(f"    {name}:{flag}) compadd -- {' '.join(shlex.quote(w) for w in words)}; return ;;")
        for flag in files:
            values.append(f"    {name}:{flag}) _files; return ;;")
        per_command.append(f"    {name}) compadd -- {' '.join(_words(sub))} ;;")
    _, top_files = _valued(parser)
    return f"""#compdef tasklease kubectl-tasklease
# zsh completion for tasklease: tasklease completion zsh > "${{fpath[1]}}/_tasklease"
_tasklease() {{
  local -a commands
  commands=({described})
  local cmd="" i
  for ((i = 2; i < CURRENT; i++)); do
    [[ ${{words[i]}} == -- ]] && {{ _normal; return }}
    if [[ -z $cmd && -n ${{commands[(r)${{words[i]}}:*]}} ]]; then cmd=${{words[i]}}; fi
  done
  case "$cmd:${{words[CURRENT-1]}}" in
{chr(10).join(values)}
    {'|'.join(f'*:{f}' for f in top_files)}) _files; return ;;
  esac
  case "$cmd" in
    "") if [[ $PREFIX == -* ]]; then compadd -- {' '.join(_words(parser))}; else _describe command commands; fi ;;
{chr(10).join(per_command)}
  esac
}}
if [[ ${{zsh_eval_context[-1]}} == loadautofunc ]]; then
  _tasklease "$@"
else
  compdef _tasklease tasklease kubectl-tasklease
fi
"""


SHELLS = {"bash": bash, "zsh": zsh}
