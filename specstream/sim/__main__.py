"""``python -m specstream.sim [options]``: the ``simulate`` subcommand, standalone."""

from __future__ import annotations

from specstream.sim.cli import main

raise SystemExit(main())
