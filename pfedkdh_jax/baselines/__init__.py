"""Baseline federated methods of method.md §5, one module per method, each with the algorithm protocol
of :mod:`pfedkdh_jax.rounds` and a ``from_config(cfg, num_classes, args)`` factory (see
:mod:`pfedkdh_jax.methods`)."""
