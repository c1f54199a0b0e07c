"""``python -m hybridzero``: the command line of :mod:`hybridzero.cli`."""

from __future__ import annotations

from hybridzero.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
