"""The runtime: everything of the cluster side that is not a rank's own training.

`actor.Runtime` is one detached Ray actor per cluster; it holds the warm process pool
(`pool`) and one `driver.AttemptDriver` per live attempt, and reconciles both with the
live attempts the control plane hands it every pass (`reconcile`). One loop (`attempts`)
moves every attempt through its phases (`phases`: pure), placing it (`placement`, with
`layout` numbering the ranks node by node) and judging how it ended (`verdict`). The
control plane reaches it only through `elastrain.service.runtime_client` and the plain
data of `elastrain.contracts.runtime`.

Importing this package loads no torch: the worker process class (`elastrain.workers.process`) is
imported when the pool is made, inside the actor.
"""
