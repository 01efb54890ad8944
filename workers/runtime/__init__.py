"""The runtime: everything of the cluster side that is not a rank's own training.

`actor.Runtime` is one detached Ray actor per cluster; it holds the warm process pool
(`pool`) and one `driver.AttemptDriver` per live attempt, and reconciles both with the
live attempts the control plane hands it every pass (`reconcile`). `layout` numbers the
ranks node by node. The control plane reaches it only through `elastrain.service.runtime_client`
and the plain data of `elastrain.contracts.runtime`.

Importing this package loads no torch: the worker process class (`elastrain.workers.process`) is
imported when the pool is made, inside the actor.
"""
