"""What a process of hfscale's own imports: transformers' optional import of peft left out where nothing uses it.

transformers imports peft whenever it is installed, to ask whether a model is a peft model; peft imports
bitsandbytes, which imports torch's compiler stack (``torch.compile`` decorators at import). On 2 CPU cores
``from transformers import Trainer`` took 11.4 s with peft 0.21 and bitsandbytes 0.50 installed and about 5 s
without (measured 2026-11-25, one idle machine). A sweep's driver never trains and a trial trains a peft model only
under ``strategy.lora``: neither needs that import, and every process of a sweep paid it.
"""

from __future__ import annotations

import sys


def leave_out_peft() -> bool:
    """Keep transformers from importing peft in this process; returns whether it was left out.

    Only for a process that trains no peft model (a driver, a trial without LoRA): transformers decides once, when
    ``transformers.trainer_utils`` is first imported, so it changes nothing after that and is permanent for the
    process. peft itself stays importable (``import peft`` still works, e.g. for LoRA's default targets).
    """
    if "transformers.trainer_utils" in sys.modules:
        return False
    try:
        import transformers.utils as transformers_utils
        from transformers.utils import import_utils
    except ImportError:
        return False
    if not hasattr(import_utils, "is_peft_available"):  # a transformers that asks differently: leave it alone
        return False

    def peft_unused() -> bool:
        return False

    import_utils.is_peft_available = peft_unused
    transformers_utils.is_peft_available = peft_unused
    return True
