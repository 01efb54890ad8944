"""`python -m api.cli`: the same command line as the `elastrain` console script."""

from api.cli import app

app()
