"""`tasklease` (and `kubectl tasklease`): parse, call, print. One clear line on error.

Rule: a command imports only what it needs: `tasklease --help` and `list` never load
kopf or the operator.
"""

from tasklease.cli.main import main

__all__ = ["main"]
