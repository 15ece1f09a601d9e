"""`python -m tasklease.cli`: the same as the `tasklease` command."""

from tasklease.cli.main import main

raise SystemExit(main())
