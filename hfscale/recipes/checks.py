"""What a recipe may say beyond its types: a run folder's name, a model transformers can build with a vocabulary the
data fits, factories that import and take their arguments, a batch the data set can fill, measurement counts in range
and a warm-up that leaves steps to measure (its ``training_args``: :mod:`hfscale.recipes.training_args`). Every check
raises :class:`hfscale.core.validation.Invalid` at the dotted key it is about.
"""

from __future__ import annotations

import difflib
import inspect
import math
from typing import Any

from hfscale.core.validation import Invalid, join_path, show_value
from hfscale.workload.spec import SEQUENTIAL_MIN_RUNS, DataSpec, MeasureSpec, ModelSpec, TrialSpec
from hfscale.workload.steps import optimizer_steps, rows_per_epoch


def check_folder_name(name: str, path: str) -> None:
    """Run folders are named after the recipe: a path (``../../x``, ``/x``) would write outside ``--out-dir``."""
    if not name or name in (".", "..") or any(sep in name for sep in ("/", "\\", "\0")):
        raise Invalid(
            path,
            f"{name!r} is not a plain folder name (it names the run folder under --out-dir): no '/', '\\', and "
            "not '.' or '..'",
        )


def check_model(model: ModelSpec, data: DataSpec) -> None:
    """Refuse an unknown ``model.type`` and token ids beyond the vocabulary now, not when the trial runs.

    Builds the config only (:func:`hfscale.workload.model.build_config`, no weights); skipped without transformers, and
    for a ``pretrained`` name whose config cannot be read here (offline): the trial then says.
    """
    if model.factory is not None or data.factory is not None:
        check_factories(model, data)
        if model.factory is not None:
            return
    if not model.pretrained:
        check_config_sizes(model)  # before the config is built: its own checks would name no key, or raise
    try:
        from hfscale.workload.model import build_config, check_vocabulary
    except ImportError:
        return
    try:
        config = build_config(model, data)
    except ImportError:  # transformers is missing: the trial checks it
        return
    except OSError:
        if model.pretrained:
            return  # a hub name offline: cannot be read here
        raise
    except ValueError as exc:
        if model.pretrained:
            raise Invalid("model.pretrained", str(exc)) from exc
        from transformers import CONFIG_MAPPING

        known = sorted(CONFIG_MAPPING.keys())
        if model.type not in known:
            close = difflib.get_close_matches(model.type, known, n=3)
            hint = f" (did you mean {', '.join(repr(c) for c in close)}?)" if close else ""
            raise Invalid(
                "model.type",
                f"unknown model type {model.type!r}{hint}: expected a transformers model_type (bert, gpt2, llama, ...)",
            ) from exc
        raise Invalid("model.config", str(exc)) from exc
    if not model.pretrained:
        check_config_keys(model)
    if data.factory is not None:
        return  # the factory's token ids are its own
    try:
        check_vocabulary(config, data)
    except ValueError as exc:
        raise Invalid("data.token_high", str(exc)) from exc
    check_positions(config, data)
    _check_labels(model, config, data)
    if not model.pretrained:
        _check_model_builds(model, data)


def _check_labels(model: ModelSpec, config: Any, data: DataSpec) -> None:
    """Refuse labels the classifier has no class for: the data's are drawn from [0, data.num_labels), and a
    ``model.config.num_labels`` that differs wins in the config (an IndexError in the first step's loss)."""
    classes = getattr(config, "num_labels", None)
    if model.task == "classification" and isinstance(classes, int) and data.num_labels > classes:
        raise Invalid(
            "data.num_labels",
            f"expected at most {classes}, the model's classes (model.config.num_labels): labels are drawn from "
            f"[0, data.num_labels), got {data.num_labels}",
        )


def _check_model_builds(model: ModelSpec, data: DataSpec) -> None:
    """Build the model on the meta device (no memory, a few hundredths of a second): a config transformers takes
    may still describe a model it cannot build (a BERT of hidden_size 1024 with its default 12 heads), and every
    trial would crash on it; the estimate, which builds the same model, only said it had none."""
    from hfscale.workload.model import build_meta_model

    try:
        build_meta_model(model, data)
    except (RuntimeError, NotImplementedError, ImportError, OSError):
        return  # what the meta device or this machine cannot do (a kernel, a package): the trial says, as the estimate
    except (ValueError, TypeError, KeyError, ArithmeticError) as exc:
        if "Unrecognized configuration class" in str(exc):  # no head of the task's kind for this model type
            raise Invalid("model.task", f"{model.task} is not a task transformers has for {model.type}: {exc}") from exc
        # A KeyError's text is only the name: a value transformers looks up (hidden_act: bogus) and does not have.
        detail = f"it has no {exc} (an activation or other name it does not know)" if isinstance(exc, KeyError) else exc
        raise Invalid("model.config", f"transformers cannot build the model from it: {detail}") from exc


def check_data(data: DataSpec) -> None:
    """Refuse dummy data that cannot be drawn (no sequence, no sample, an empty range of token ids) at its key."""
    for key in ("num_samples", "seq_len", "num_labels"):
        if getattr(data, key) < 1:
            raise Invalid(f"data.{key}", f"expected a positive integer, got {getattr(data, key)}")
    if data.factory is None and not 0 <= data.token_low < data.token_high:
        raise Invalid(
            "data.token_low",
            f"expected 0 <= data.token_low < data.token_high (ids are drawn from [token_low, token_high)), got "
            f"{data.token_low} and {data.token_high}",
        )


_LEARNED_POSITIONS = {"bert": "max_position_embeddings", "distilbert": "max_position_embeddings",
                      "gpt2": "n_positions", "roberta": "max_position_embeddings",
                      "xlm-roberta": "max_position_embeddings", "camembert": "max_position_embeddings"}  # fmt: skip
"""Model types with a table of learned absolute positions, and its size's config key. Only these are checked:
others have rotary or relative positions (any length runs), or limits this table does not know."""


def check_positions(config: Any, data: DataSpec) -> None:
    """Refuse sequences longer than a model with learned absolute positions has positions for (BERT's 512, GPT-2's
    1024: the first forward fails deep inside the embedding). RoBERTa's positions start after its padding id, so
    it has ``pad_token_id + 1`` fewer."""
    key = _LEARNED_POSITIONS.get(getattr(config, "model_type", ""))
    if key is None or not getattr(config, key, None):
        return
    offset = (config.pad_token_id or 0) + 1 if "roberta" in config.model_type or config.model_type == "camembert" else 0
    limit = getattr(config, key) - offset
    if data.seq_len > limit:
        why = f"model.config.{key}" + (f" less the {offset} before RoBERTa's first position" if offset else "")
        raise Invalid("data.seq_len", f"expected at most {limit}, the model's positions ({why}), got {data.seq_len}")


def check_measured_steps(measure: MeasureSpec, path: str) -> None:
    """A trial's warm-up must leave steps to measure: the throughput figures need two steps after the warm-up
    (with fewer, none would come out: the row would say none was measured, after the whole run)."""
    warmup = measure.warmup_steps
    if isinstance(warmup, int) and measure.max_steps is not None and measure.max_steps < warmup + 2:
        raise Invalid(
            join_path(path, "warmup_steps"),
            f"expected at most max_steps - 2 ({measure.max_steps - 2}), or 'auto': the steps after the warm-up are "
            f"the ones measured, and a figure needs two, got {warmup}",
        )


def check_epoch_steps(spec: TrialSpec, path: str) -> None:
    """:func:`check_measured_steps` for a run of ``num_epochs`` epochs, whose optimizer steps follow from the data
    and the batch (:func:`~hfscale.workload.steps.optimizer_steps`, the Trainer's count; unchecked where only the
    run knows it)."""
    measure, warmup = spec.measure, spec.measure.warmup_steps
    if measure.max_steps is not None or not isinstance(warmup, int):
        return  # capped by max_steps (checked above), or a detected warm-up
    steps = optimizer_steps(spec)
    if steps is not None and steps < warmup + 2:
        rows = rows_per_epoch(spec.data)
        packed = (
            f" (the rows data.num_samples {spec.data.num_samples} packs into)" if spec.data.packing == "pack" else ""
        )
        raise Invalid(
            join_path(path, "warmup_steps"),
            f"{measure.num_epochs:g} epoch(s) of {rows} samples{packed} at {spec.strategy.global_batch_size} a step "
            f"run at most {steps} optimizer step(s): a warm-up of {warmup} leaves fewer than the two the throughput "
            "figures need; train more epochs or samples, or lower warmup_steps",
        )


def check_lengths(model: ModelSpec, data: DataSpec) -> None:
    """Refuse variable lengths that cannot be drawn, and packing where it means nothing (classification, or rows
    that are already full), at their keys."""
    lengths = data.lengths
    if data.factory is not None and (lengths is not None or data.packing != "pad"):
        key = "data.lengths" if lengths is not None else "data.packing"
        raise Invalid(key, "shapes hfscale's dummy data: not with data.factory (your data set has its own lengths)")
    if data.packing == "pack" and lengths is None:
        raise Invalid("data.packing", "pack needs data.lengths: fixed-length rows are already full")
    if data.packing == "pack" and model.task != "causal_lm":
        raise Invalid("data.packing", f"pack joins sequences into rows: only for task causal_lm, not {model.task}")
    if lengths is None:
        return
    if not 1 <= lengths.min <= data.seq_len:
        raise Invalid("data.lengths.min", f"expected 1 to data.seq_len ({data.seq_len}), got {lengths.min}")
    if lengths.distribution == "normal" and (lengths.mean is None or lengths.sd is None or lengths.sd <= 0):
        raise Invalid("data.lengths", "normal needs mean and a positive sd")
    if lengths.distribution == "histogram":
        bad = [k for k, w in lengths.histogram.items() if not 1 <= k <= data.seq_len or not 0 < w < math.inf]
        if not lengths.histogram or bad:
            raise Invalid(
                "data.lengths.histogram",
                f"expected lengths 1 to data.seq_len ({data.seq_len}) with positive weights"
                + (f"; not {bad}" if bad else ", got none"),
            )


def check_factories(model: ModelSpec, data: DataSpec) -> None:
    """Refuse a ``model.factory`` or ``data.factory`` that does not import or names no function, and keyword
    arguments its function does not take (``model.config`` for a model factory, ``data.factory_kwargs``), now:
    the trial raised a TypeError on them."""
    from hfscale.workload.factory import load_callable

    for key, reference, kwargs, kwargs_key in (
        ("model.factory", model.factory, model.config, "model.config"),
        ("data.factory", data.factory, data.factory_kwargs, "data.factory_kwargs"),
    ):
        if reference is None:
            continue
        try:
            function = load_callable(reference)
        except ValueError as exc:
            raise Invalid(key, str(exc)) from exc
        try:
            signature = inspect.signature(function)
        except (TypeError, ValueError):  # a builtin without one: the trial checks the call
            continue
        try:
            signature.bind(**kwargs)
        except TypeError as exc:
            raise Invalid(kwargs_key, f"{reference} does not take these keyword arguments: {exc}") from exc


# Keys transformers 5 still takes and folds into ``rope_parameters`` (configs on the Hub carry them).
_LEGACY_CONFIG_KEYS = frozenset({"rope_theta", "rope_scaling"})


SIZE_KEYS = frozenset(
    {
        "vocab_size",
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "intermediate_size",
        "max_position_embeddings",
        "n_embd",
        "n_layer",
        "n_head",
        "n_inner",
        "n_positions",
        "d_model",
        "d_ff",
        "num_layers",
        "num_heads",
    }
)
"""``model.config`` keys that size the model (transformers' names and GPT-2's and T5's): a count of something."""


def check_config_sizes(model: ModelSpec) -> None:
    """Refuse a size of the model that is not a positive integer (``hidden_size: 0`` builds a config, then fails
    in the estimate and inside the trial with a ``ZeroDivisionError``). ``null`` stays: some sizes default to it.

    Raises:
        Invalid: at ``model.config.KEY``.
    """
    for key, value in model.config.items():
        if key in SIZE_KEYS and value is not None and (type(value) is not int or value <= 0):
            raise Invalid(f"model.config.{key}", f"expected a positive integer, got {value!r}")


def check_config_keys(model: ModelSpec) -> None:
    """Refuse a ``model.config`` key the model type's config class does not have.

    transformers keeps any unknown keyword as a plain attribute, so a misspelt ``num_key_value_head`` would build
    a model with the default number of KV heads and nothing would say so. A key is known when it is a parameter
    of the config class (or of ``PretrainedConfig``), an alias in its ``attribute_map``, or an attribute of its
    default instance (``num_labels``).

    Raises:
        Invalid: at ``model.config.KEY``, naming the config class and the closest valid key.
    """
    from transformers import CONFIG_MAPPING, PretrainedConfig

    if model.type not in CONFIG_MAPPING:
        return
    cls = CONFIG_MAPPING[model.type]
    known = {
        name
        for klass in (cls, PretrainedConfig)
        for name, param in inspect.signature(klass.__init__).parameters.items()
        if param.kind not in (param.VAR_KEYWORD, param.VAR_POSITIONAL) and name != "self"
    }
    known |= set(getattr(cls, "attribute_map", {})) | _LEGACY_CONFIG_KEYS
    default = None
    for key in model.config:
        if key in known:
            continue
        if default is None:
            default = cls()
        if hasattr(default, key):
            continue
        close = difflib.get_close_matches(key, sorted(known), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise Invalid(
            join_path("model.config", key),
            f"{cls.__name__} has no key {key!r}{hint}; transformers would keep it as an unused attribute",
        )


def check_liger(strategy: Any, model: ModelSpec, path: str) -> None:
    """Refuse ``use_liger_kernel`` for a model type Liger does not patch (:mod:`hfscale.techniques.kernels`): it would
    log at info level and train the model unpatched."""
    from hfscale.techniques.kernels import check_liger_model_type

    if model.factory is not None and getattr(strategy, "use_liger_kernel", False):
        raise Invalid(
            join_path(path, "use_liger_kernel"), "Liger patches transformers model types, not a model.factory"
        )
    try:
        check_liger_model_type(strategy, model.type if not model.pretrained else None)
    except ValueError as exc:
        raise Invalid(join_path(path, "use_liger_kernel"), str(exc)) from exc


def check_lora(strategy: Any, model: ModelSpec, path: str) -> None:
    """Refuse ``lora`` without ``target_modules`` on a model type peft has no default targets for
    (:func:`hfscale.techniques.lora.default_target_modules`): the trial would stop at its start. Skipped without peft
    (the trial names the extra) and for a ``pretrained`` model (its type is only known from its config)."""
    lora = getattr(strategy, "lora", None)
    if lora is None or lora.target_modules is not None or model.pretrained:
        return
    if model.factory is not None:
        raise Invalid(
            join_path(join_path(path, "lora"), "target_modules"),
            "a model.factory model has no default LoRA targets: name its Linear layers (target_modules: [q_proj])",
        )
    from hfscale.techniques.lora import default_target_modules

    try:
        default_target_modules(model.type)
    except ImportError:
        return
    except ValueError as exc:
        raise Invalid(join_path(join_path(path, "lora"), "target_modules"), str(exc)) from exc


def check_tensor_parallel(model: ModelSpec, data: DataSpec, strategy: Any, path: str) -> None:
    """Refuse a mesh the installed libraries cannot train (:mod:`hfscale.techniques.mesh_limits`: tensor parallel
    beside replicas alone, or beside context or sequence parallel where transformers loads it through its own
    mesh), a mesh the installed accelerate refuses (context parallel beside replicas alone), and ``parallelism.tp >
    1`` for a model type without a tensor-parallel plan (``base_model_tp_plan``), at the trial that asks for it
    (:func:`hfscale.techniques.mesh.tp_plan_problem` says why and which model types have one). Skipped where the
    config cannot be built here: :func:`check_model` has said why, or the trial will."""
    from hfscale.configs.fsdp import transformers_fsdp_refusal
    from hfscale.techniques.mesh import accelerate_parallelism_config, tensor_parallel, tp_plan_problem
    from hfscale.techniques.mesh_limits import replicas_beside_tp, tp_beside_other_dims

    for why in (replicas_beside_tp(strategy), tp_beside_other_dims(strategy)):
        if why is not None:
            raise Invalid(join_path(path, "parallelism"), why)
    if (setting := transformers_fsdp_refusal(strategy)) is not None:
        raise Invalid(join_path(path, setting[0]), setting[1])
    if strategy.parallelism is not None:
        try:  # what accelerate refuses in the sizes, said now
            accelerate_parallelism_config(strategy)
        except ImportError:
            pass
        except ValueError as exc:
            raise Invalid(join_path(path, "parallelism"), f"accelerate refuses this mesh: {exc}") from exc
    if not tensor_parallel(strategy):
        return
    if model.factory is not None:
        raise Invalid(
            join_path(path, "parallelism"), "tensor parallelism reloads a transformers model: not a model.factory"
        )
    try:
        from hfscale.workload.model import build_config

        config = build_config(model, data)
    except (ImportError, OSError, ValueError):
        return
    problem = tp_plan_problem(config, strategy)
    if problem is not None:
        raise Invalid(join_path(join_path(path, "parallelism"), "tp"), problem)


def check_batch_fits_data(strategy: Any, data: DataSpec, path: str) -> None:
    """Refuse a trial whose one optimizer step takes more samples than ``data.num_samples`` holds.

    The Trainer does not refuse it: it trains on the samples there are, so the steps run a smaller batch than the
    strategy asks, and the trial is launched only to end ``not_applied`` (issue 28: 16 samples ran, 64 were asked
    for). One step takes :attr:`~hfscale.strategy.Strategy.global_batch_size` samples: the per-device batch times
    the accumulation steps times the data-parallel replicas (every process, less the ranks of one tensor, context
    or sequence parallel group, which share their batch), as the verification counts them.

    Raises:
        Invalid: at ``PATH.per_device_batch_size``, naming the product and ``data.num_samples``.
    """
    rows = rows_per_epoch(data)
    need = strategy.global_batch_size
    if rows is None or rows >= need:
        return  # enough, or a factory's data set, known only when it runs
    replicas = need // (strategy.per_device_batch_size * strategy.gradient_accumulation_steps)
    have = f"data.num_samples {rows}"
    if data.packing == "pack":
        have = f"the {rows} rows that data.num_samples {data.num_samples} packs into"
    raise Invalid(
        join_path(path, "per_device_batch_size"),
        f"one optimizer step takes {need} samples (batch {strategy.per_device_batch_size} x accumulation "
        f"{strategy.gradient_accumulation_steps} x {replicas} data-parallel replica(s)), more than {have}: the steps "
        "would train on smaller batches than asked; lower the batch or "
        + ("raise data.num_samples" if data.packing == "pack" else f"set data.num_samples to {need} or more"),
    )


def check_measure(measure: MeasureSpec, path: str) -> None:
    """Range checks for :class:`~hfscale.workload.spec.MeasureSpec` (the dataclass itself only holds the values)."""
    warmup = measure.warmup_steps
    if warmup != "auto" and (isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0):
        raise Invalid(
            join_path(path, "warmup_steps"),
            f"expected an integer 0 or more, or 'auto' to detect the warm-up from each run's step times, got "
            f"{show_value(warmup)}",
        )
    if measure.max_steps is not None and measure.max_steps < 1:
        raise Invalid(join_path(path, "max_steps"), f"expected a positive integer or null, got {measure.max_steps}")
    if measure.num_epochs <= 0:
        raise Invalid(join_path(path, "num_epochs"), f"expected a positive number, got {measure.num_epochs}")
    if measure.repeats < 1:
        raise Invalid(join_path(path, "repeats"), f"expected a positive integer, got {measure.repeats}")
    if measure.timeout_s <= 0:
        raise Invalid(join_path(path, "timeout_s"), f"expected a positive number of seconds, got {measure.timeout_s}")
    if measure.target_precision is not None and not 0 < measure.target_precision < 1:
        raise Invalid(
            join_path(path, "target_precision"),
            f"expected a fraction between 0 and 1 (0.05 for ± 5%), got {measure.target_precision}",
        )
    fewest = max(measure.repeats, SEQUENTIAL_MIN_RUNS)
    if measure.target_precision is not None and measure.max_repeats < fewest:
        raise Invalid(
            join_path(path, "max_repeats"),
            f"expected at least {fewest} (repeats, and the {SEQUENTIAL_MIN_RUNS} runs a target precision takes "
            f"before it may stop), got {measure.max_repeats}",
        )
    if measure.max_time_s is not None and measure.max_time_s <= 0:
        raise Invalid(join_path(path, "max_time_s"), f"expected a positive number of seconds, got {measure.max_time_s}")


__all__ = [
    "check_batch_fits_data",
    "check_config_keys",
    "check_config_sizes",
    "check_data",
    "check_epoch_steps",
    "check_folder_name",
    "check_measure",
    "check_measured_steps",
    "check_model",
    "check_positions",
]
