"""The Gluon one-read MLA kernels for Hopper (registry entries ``gluon_*``): the lock-step form
(``lock_step.py``), the role-split form (``roles.py``), the seesaw form (``seesaw.py``) and the
two fp8 latent forms (``fp8.py``, ``fp8_narrow.py``). ``common.py`` holds what they share: the
Gluon imports and the names that moved between Triton releases, the config and the shape
checks, and the device helpers of the warp-specialised forms (mask rows, causal caps, the
scorer warpgroup, the output stores), public so that no kernel imports from a sibling."""
