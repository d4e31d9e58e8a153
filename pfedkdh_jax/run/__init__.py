"""The run layer: options and presets (:mod:`.config`), a whole experiment (:mod:`.experiment`),
what it writes (:mod:`.records`), checkpoints (:mod:`.checkpoint`), reports and figures
(:mod:`.report`, :mod:`.plots`) and the command line (:mod:`.cli`). A thin host layer over the pure
functions of :mod:`pfedkdh_jax.engine` and :mod:`pfedkdh_jax.algorithms`."""

import sys
import types


class _CallablePackage(types.ModuleType):
    """``pfedkdh_jax.run`` is this package and the public function :func:`pfedkdh_jax.run.experiment.run`
    at once: importing any of its modules binds the package to the name ``run`` of ``pfedkdh_jax``
    (Python's import system does), so the package itself takes the function's call."""

    def __call__(self, cfg, **kwargs):
        from pfedkdh_jax.run.experiment import run
        return run(cfg, **kwargs)


sys.modules[__name__].__class__ = _CallablePackage
