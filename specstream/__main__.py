from __future__ import annotations

import sys

from specstream.cli import main

sys.exit(main())
