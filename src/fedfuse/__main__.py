"""``python -m fedfuse`` runs the command-line tool."""

from fedfuse.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
