"""The run layer: options and presets (:mod:`.config`), a whole experiment (:mod:`.experiment`),
what it writes (:mod:`.records`), checkpoints (:mod:`.checkpoint`), reports and figures
(:mod:`.report`, :mod:`.plots`) and the command line (:mod:`.cli`). A thin host layer over the pure
functions of :mod:`pfedkdh_jax.engine` and :mod:`pfedkdh_jax.algorithms`.

Called, this package is :func:`pfedkdh_jax.run.experiment.run`, ``run(cfg, *, progress=True, log=print,
return_state=False, resume=False)``: once any of its modules is imported (``make_config`` imports one),
``pfedkdh_jax.run`` names the package, not the function. ``help(pfedkdh_jax.run.experiment.run)`` tells
what each argument does."""

import sys
import types


class _CallablePackage(types.ModuleType):
    """``pfedkdh_jax.run`` is this package and the public function :func:`pfedkdh_jax.run.experiment.run`
    at once: importing any of its modules binds the package to the name ``run`` of ``pfedkdh_jax``
    (Python's import system does), so the package itself takes the function's call."""

    def __call__(self, cfg, *, progress: bool = True, log=print, return_state: bool = False, resume: bool = False):
        """Run the experiment described by ``cfg``: :func:`pfedkdh_jax.run.experiment.run`."""
        from pfedkdh_jax.run.experiment import run
        return run(cfg, progress=progress, log=log, return_state=return_state, resume=resume)


sys.modules[__name__].__class__ = _CallablePackage
