"""``python -m hpcpar`` (under ``mpiexec -n N`` or alone)."""

from .cli import main

raise SystemExit(main())
