"""The run layer: options and presets (:mod:`.config`), a whole experiment (:mod:`.experiment`),
what it writes (:mod:`.records`), checkpoints (:mod:`.checkpoint`), reports and figures
(:mod:`.report`, :mod:`.plots`) and the command line (:mod:`.cli`). A thin host layer over the pure
functions of :mod:`pfedkdh_jax.engine` and :mod:`pfedkdh_jax.algorithms`."""
