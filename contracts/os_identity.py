"""Which OS identity a tenant's scripts run as: the operator's map (`ELASTRAIN_TENANT_USERS`),
as Slurm runs a job as its user. Plain data, parsed and checked here; the worker that
starts a `workload.command` script switches to it (`elastrain.workers.command`).

`tenant=uid[:gid]` entries, comma-separated, numeric ids (a name means nothing across the
cluster's nodes unless every node resolves it alike; ids do): `team-a=2001:2001,team-b=2002`.
A gid left out is the uid. Root (0) is never an identity a tenant's code runs as.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RunAs:
    uid: int
    gid: int

    def __str__(self) -> str:
        return f"{self.uid}:{self.gid}"

    @classmethod
    def parse(cls, text: str) -> RunAs:
        uid_text, _, gid_text = text.partition(":")
        try:
            uid = int(uid_text)
            gid = int(gid_text) if gid_text else uid
        except ValueError:
            raise ValueError(f"{text!r}: expected uid[:gid], numeric") from None
        if uid <= 0 or gid <= 0 or uid >= 2**32 - 1 or gid >= 2**32 - 1:
            raise ValueError(f"{text!r}: ids must be 1..4294967294 (never root)")
        return cls(uid, gid)


def parse_tenant_users(entries: list[str]) -> dict[str, RunAs]:
    """`tenant=uid[:gid]` entries as a map; ValueError naming a bad entry."""
    found: dict[str, RunAs] = {}
    for entry in entries:
        tenant, sep, ids = entry.partition("=")
        tenant = tenant.strip()
        if not sep or not tenant:
            raise ValueError(f"ELASTRAIN_TENANT_USERS: {entry!r} is not tenant=uid[:gid]")
        try:
            found[tenant] = RunAs.parse(ids.strip())
        except ValueError as exc:
            raise ValueError(f"ELASTRAIN_TENANT_USERS: {tenant}: {exc}") from None
    return found
