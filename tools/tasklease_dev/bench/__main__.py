"""`python -m tasklease_dev.bench`: the bench (`make bench`), or one of its worker processes."""

from tasklease_dev.bench.run import main

raise SystemExit(main())
