"""Ray actors as the loader's workers: :class:`RayWorkers`, given as ``workers=``.

::

    training process (the loader's event loop)              actors (any node of the cluster)
    ──────────────────────────────────────────              ────────────────────────────────
    epoch ── BatchRequest ──▶ RayRunner (_runner) ── make.remote ──▶ LoaderActor (_actor)
                               Fleet (_fleet): which actor,            fetch (async data), read,
                               deaths, kills, replacements             transform, collate
    epoch ◀── Made ◀── opened (_wire) ◀──── Ray object store ◀──── as_arrays (_wire)

    RayWorkers (_pool): the WorkerPool a loader attaches to; the connection, the loop for `for`

One module a job: ``_wire`` what a batch is on its way (and the read-only rule), ``_actor``
what runs in an actor, ``_fleet`` the actors' lives, ``_runner`` the epoch's runner,
``_pool`` the public object. Ray is imported only once actors are needed (the ``ray`` extra).

This module only re-exports.
"""

from __future__ import annotations

from ._pool import ActorStatistics as ActorStatistics
from ._pool import RayWorkers as RayWorkers
from ._pool import RayWorkersStatistics as RayWorkersStatistics
