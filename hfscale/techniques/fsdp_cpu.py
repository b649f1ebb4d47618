"""FSDP2 on CPU through accelerate: the one adjustment accelerate needs, applied only in a process that asks.

A trial applies it itself; a user's own script adds :data:`SCRIPT_LINE` before ``TrainingArguments`` (``hfscale
config`` prints it for an FSDP strategy on CPU).

On a machine without an accelerator, ``accelerate`` (1.10 to at least 1.15) decides the distributed type in
``PartialState._prepare_backend``: several CPU processes are ``MULTI_CPU``. ``AcceleratorState.__init__`` only
switches to ``FSDP`` when the type is one of the ``MULTI_<ACCELERATOR>`` kinds, so on CPU an FSDP request (an
``fsdp_plugin`` from ``TrainingArguments.fsdp`` or ``ACCELERATE_USE_FSDP`` from ``accelerate launch``) is
dropped without a word: the Trainer then wraps the model in DDP (``use_cpu=True``) or trains independent copies.

PyTorch's FSDP2 (``fully_shard``) itself runs on a CPU device mesh over gloo, and every later FSDP2 step in
accelerate (``Accelerator._prepare_fsdp2`` -> ``fsdp2_prepare_model``, which calls ``fully_shard`` with the
default mesh) works on CPU. So the adjustment is narrow: after ``AcceleratorState`` is built, if it is
``MULTI_CPU`` and an FSDP2 plugin was handed over, make the state what it would have been on a GPU machine
(``distributed_type = FSDP``, ``fsdp_plugin`` set, the plugin told the mixed precision). FSDP1 is left alone: it
needs an accelerator device (``hfscale.strategy`` refuses it on CPU).

Hybrid sharding (HSDP) needs nothing more: its 2-D mesh comes from accelerate's ``parallelism_config``
(``dp_replicate`` machines x ``dp_shard`` processes each, :func:`hfscale.configs.fsdp.parallelism_section`), which
accelerate builds with ``init_device_mesh`` on the state's device type, ``cpu`` here, and hands to ``fully_shard``.
Measured with 2 machines x 2 processes on one host (``tests/techniques/test_multi_machine.py``): FSDP's own mesh is
``dp_replicate 2 x dp_shard 2``, the shard groups are ranks ``[0, 1]`` and ``[2, 3]`` (one per machine), and each
rank holds half the parameters.

Whether the adjustment took effect is not assumed: ``hfscale.measure.verify`` reads the distributed type, the wrapper
class and the parameters held per rank from inside the run, and a trial whose record says DDP is ``not_applied``.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from hfscale.configs.fsdp import fsdp_by_accelerate
from hfscale.techniques.base import ScriptLine, Technique, patch_once

if TYPE_CHECKING:
    from hfscale.strategy import Strategy

logger = logging.getLogger(__name__)

SCRIPT_LINE = "import hfscale.techniques.fsdp_cpu; hfscale.techniques.fsdp_cpu.enable_fsdp2_on_cpu()"
"""The line a user's own training script needs, before ``TrainingArguments``, to run an FSDP strategy on CPU
(``hfscale config`` prints it; no launcher setting can make accelerate take its FSDP path there)."""


def needed(strategy: Strategy) -> bool:
    """Whether ``strategy`` runs FSDP on CPU, where :func:`enable_fsdp2_on_cpu` is needed (with one process too:
    accelerate launches FSDP through torchrun, so a single CPU process is a ``MULTI_CPU`` world of one). Not where
    transformers shards the model itself (:func:`~hfscale.configs.fsdp.fsdp_by_transformers`): accelerate gets no
    FSDP there."""
    return fsdp_by_accelerate(strategy) and strategy.device == "cpu"


def enable_fsdp2_on_cpu() -> None:
    """Let accelerate take its FSDP2 path for a multi-process CPU run, for the rest of this process.

    Idempotent. Call it before the ``Trainer`` (or ``Accelerator``) is created, and only in a process that is meant
    to train with FSDP on CPU: the patch changes nothing for other distributed types, but it is process-wide.
    """
    from accelerate.state import AcceleratorState

    patch_once(AcceleratorState, "__init__", _switching_init)


def _switching_init(original: Callable[..., None]) -> Callable[..., None]:
    """``AcceleratorState.__init__`` followed by :func:`_switch_multi_cpu_to_fsdp2` with the plugin it was given."""
    signature = inspect.signature(original)

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        fsdp_plugin = signature.bind_partial(self, *args, **kwargs).arguments.get("fsdp_plugin")
        _switch_multi_cpu_to_fsdp2(self, fsdp_plugin)

    return __init__


def _switch_multi_cpu_to_fsdp2(state: Any, fsdp_plugin: Any) -> None:
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    if fsdp_plugin is None or state.distributed_type != DistributedType.MULTI_CPU:
        return
    if getattr(fsdp_plugin, "fsdp_version", 1) != 2:
        logger.warning(
            "FSDP%s requested on CPU: left as MULTI_CPU (only FSDP2 runs on CPU)",
            getattr(fsdp_plugin, "fsdp_version", 1),
        )
        return
    # What AcceleratorState.__init__ does for MULTI_GPU & co. when an FSDP plugin is given (accelerate/state.py).
    state.distributed_type = DistributedType.FSDP
    if state._mixed_precision != "no":
        fsdp_plugin.set_mixed_precision(state._mixed_precision)
    state.fsdp_plugin = fsdp_plugin
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    logger.info("accelerate state switched from MULTI_CPU to FSDP (FSDP2 on a CPU device mesh)")


def script_lines(strategy: Strategy) -> list[ScriptLine]:
    """``(why, line)`` for a user's own script: :data:`SCRIPT_LINE` when :func:`needed`, else nothing."""
    if not needed(strategy):
        return []
    return [
        (
            "your script needs this line before TrainingArguments (without it accelerate runs DDP, not FSDP, on CPU)",
            SCRIPT_LINE,
        )
    ]


class FsdpCpu(Technique):
    """FSDP2 on CPU processes: accelerate's state patched before ``TrainingArguments``; what ran is read by the
    verification's own fields (distributed type, wrapper, parameters held per rank), so nothing of its own."""

    name = "fsdp_cpu"

    def prepare_arguments(self, strategy: Strategy) -> dict[str, Any]:
        if needed(strategy):
            enable_fsdp2_on_cpu()
        return {}

    script_lines = staticmethod(script_lines)


TECHNIQUE = FsdpCpu()
"""This module's :class:`~hfscale.techniques.base.Technique` (registered in ``hfscale.techniques.TECHNIQUES``)."""

__all__ = ["SCRIPT_LINE", "TECHNIQUE", "FsdpCpu", "enable_fsdp2_on_cpu", "needed", "script_lines"]
