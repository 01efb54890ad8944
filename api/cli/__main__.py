"""`python -m elastrain.api.cli`: the same command line as the `elastrain` console script."""

from elastrain.api.cli import app

app()
