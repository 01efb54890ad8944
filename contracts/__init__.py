"""Contracts that cross process and package boundaries, as plain typed data.

The job spec (`elastrain.contracts.spec`), the messages between workers, driver and scheduler
(`elastrain.contracts.messages`) and the storage layout of a job (`elastrain.contracts.storage`) live here so
that `api`, `service`, `workers` and `checkpoints` share one definition of each. This package
imports only the standard library and pydantic: never torch, ray or sqlalchemy
(tests/unit/test_imports.py).
"""
