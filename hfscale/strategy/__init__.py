"""What a training strategy is: one frozen, validated description that every config generator reads.

:class:`Strategy` (``strategy.py``) and its nested engine specs (``specs.py``); import them from here. The names are
``strategy.py``'s ``__all__``, which lists the specs too.
"""

from hfscale.strategy.strategy import *  # noqa: F403
from hfscale.strategy.strategy import __all__  # noqa: F401
