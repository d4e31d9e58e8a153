"""The engine every method runs on.

=========================  ==========================================================================
:mod:`.local`              ``LocalTrainer``: local SGD over a padded client (the one training loop)
:mod:`.layout`             ``Layout``: clients vmapped or sequential, steps scanned or unrolled, per
                           backend; XLA:CPU compiler options of local training
:mod:`.round`              ``make_round(algo, layout)``: a round as a pure function, and its pieces
:mod:`.evaluate`           ``make_evaluate(algo, layout)``: an evaluation as a pure function
:mod:`.scoring`            accuracies of the models an evaluation holds
:mod:`.client_rows`        ``ClientRows``: per-client values kept only for the clients that have one
:mod:`.runner`             ``RoundRunner``: the host loop that compiles and calls the pieces
:mod:`.sharding`           a piece per device (``shard_map``)
:mod:`.cpu_devices`        XLA:CPU host devices for spreading sequential clients (no JAX import)
=========================  ==========================================================================
"""
