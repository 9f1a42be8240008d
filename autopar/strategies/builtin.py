"""The built-in sharding rules: importing this module registers them all.

Each rule file registers its ops with :func:`autopar.strategies.register_rule` when
imported; this module only imports them, so the set of built-in rules is listed in one
place. Ops with a data-dependent output shape (``nonzero``, ``histc``, ...) deliberately
have no rule and run replicated (on the batch axis they run on each rank's own tokens:
:mod:`autopar.analysis.batch_axis`).
"""

from autopar.strategies import (  # noqa: F401  (imported for their registrations)
    attention,
    conv,
    embedding,
    factories,
    inplace,
    losses,
    matmul,
    norms,
    pointwise,
    reductions,
    routing,
    scatter,
    spatial,
    views,
)

# Last: ``op_`` gets the rule of ``op``, filtered to keep the written tensor's placement.
IN_PLACE_FORMS = inplace.register_in_place_forms()
