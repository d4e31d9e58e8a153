"""``python -m pfedkdh_jax ...`` is the ``pfedkdh`` command."""

import sys

from pfedkdh_jax.run.cli import main

sys.exit(main())
