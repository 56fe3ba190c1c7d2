"""``python -m wf_persist.cli``: the same as the ``wf-persist`` console script."""

from . import main

main()
