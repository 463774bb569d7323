"""functrain's lowest layer, internal: what every other part builds on and nothing here imports from above.

Atomic file writes (:mod:`~functrain.core.atomic`), per-tensor list arithmetic
(:mod:`~functrain.core.foreach`), lazy package namespaces (:mod:`~functrain.core.lazy`), attribute patches
(:mod:`~functrain.core.patch`), a tree's paths (:mod:`~functrain.core.tree_walk`), a model's tensors
(:mod:`~functrain.core.variables`), padded batches (:mod:`~functrain.core.masked_batch`) and an ensemble's
member axis (:mod:`~functrain.core.member_axis`). The public core (``functrain.tree``, ``functrain.random``,
``functrain.precision``) stays at the package's root.
"""
