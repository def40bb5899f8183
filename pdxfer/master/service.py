"""The pdxfer-master process's entry points: the console script ``pdxfer-master`` (``main``) and
``python -m pdxfer.master.service``. The server is in server/master_service.py and the process around it (flags,
signals, the coordinator) in cli.py; this module only starts it, so nothing imports back."""

from __future__ import annotations

import sys

from pdxfer.master.cli import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
