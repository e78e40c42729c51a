"""`python -m dataservice ...`: the same program as the `dataservice` command."""

from dataservice.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
