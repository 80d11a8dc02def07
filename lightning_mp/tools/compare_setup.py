"""What ``python -m lightning_mp compare`` trains: the model, the data and the Trainer settings, from its flags.

Three ways to say it, which combine:

- ``--model pkg.mod:Class`` (or a built-in name) with ``--model.NAME VALUE`` per constructor argument (values are
  YAML: ``512``, ``true``, ``[1, 2]``, ``null``), and likewise ``--datamodule`` / ``--data.NAME VALUE`` and
  ``--trainer.NAME VALUE``;
- ``--model-args '{"width": 512}'`` (and ``--datamodule-args``): the same as one JSON object (the older spelling);
- ``--config train.yaml``: a Lightning CLI config, as ``MPLightningCLI``/``LightningCLI`` read it for ``fit``
  (``trainer:``, ``model:``, ``data:``, ``optimizer:``, ``lr_scheduler:``, ``seed_everything:``). The model and the
  data are built from it by the same parser (jsonargparse), once per mode; the Trainer settings that change what a
  step computes or costs are kept (:data:`KEPT_TRAINER_ARGS`: accumulation, clipping, ...), and the settings of an
  ``MPPlugin`` in ``trainer.plugins`` (loss scaling, FP32 guards, master weights, skips) go into every mode's
  plugin. ``--model.NAME``-style flags override the file.

Every problem is an :class:`InputError` naming the flag and the value, printed as one line.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import json
import os
import tempfile
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

#: Trainer arguments kept from the user's setup: they change what a step computes or what it costs
KEPT_TRAINER_ARGS = (
    "accumulate_grad_batches",
    "gradient_clip_val",
    "gradient_clip_algorithm",
    "deterministic",
    "benchmark",
    "detect_anomaly",
    "limit_train_batches",
    "use_distributed_sampler",
    "reload_dataloaders_every_n_epochs",
    "inference_mode",
)
#: Trainer arguments compare sets itself and that change nothing a step computes: dropped without a word
SILENT_TRAINER_ARGS = (
    "logger", "enable_checkpointing", "enable_progress_bar", "enable_model_summary", "val_check_interval",
    "check_val_every_n_epoch", "limit_val_batches", "limit_test_batches", "limit_predict_batches",
    "num_sanity_val_steps", "log_every_n_steps", "accelerator", "max_steps", "max_epochs", "max_time", "min_steps",
    "min_epochs", "default_root_dir",
)
#: strategies that run on one device and are kept
SINGLE_DEVICE_STRATEGIES = ("auto", "single_device", None)
#: MPPlugin arguments that each mode sets itself
MODE_PLUGIN_ARGS = ("precision", "device", "scaler")

BUILTIN_MODELS = {
    "gpt-mini": "lightning_mp.tools.demo:TinyByteLM",
    # the repository's examples (run from the repository root)
    "examples.gpt_mini": "examples.gpt_mini:GPTMini",
    "examples.vlm_mini": "examples.vlm_mini:VLMMini",
}
BUILTIN_DATAMODULES = {
    "examples.gpt_mini": "examples.gpt_mini:ByteTextDataModule",
    "examples.vlm_mini": "examples.vlm_mini:DigitCaptionDataModule",
}


class InputError(ValueError):
    """A bad flag or value; ``str()`` is ``"<flag>: <what is wrong>"``, printed as ``error: ...``, exit status 2."""

    def __init__(self, flag: str, message: str) -> None:
        super().__init__(f"{flag}: {message}")
        self.flag = flag


# --------------------------------------------------------------------------------------------- built-in sizes
def builtin_size(device_type: str) -> dict[str, Any]:
    """The built-in GPT-mini's size for the device, so that the default run shows what precision does there.

    CPU: the small default (width 128, 2 layers, 1,024 tokens a step). CUDA with 40 GB or more (A100, H100, H200):
    width 2048, 4 layers, 8,192 tokens a step (GEMMs of 8192 x 2048 x 8192, ~10 TFLOP a step: compute-bound, where
    bf16 and fp8 tensor cores pay off; about 3.2 GB of weights, gradients and Adam state per mode, and every mode is
    resident at once). Smaller GPUs: width 1024, 4 layers, 4,096 tokens a step.
    """
    if device_type != "cuda":
        return {}
    import torch

    total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    if total >= 40 * 2**30:
        return {"width": 2048, "layers": 4, "heads": 16, "seq_len": 512, "batch_size": 16, "lr": 1e-3}
    return {"width": 1024, "layers": 4, "heads": 8, "seq_len": 256, "batch_size": 16, "lr": 1e-3}


# --------------------------------------------------------------------------------------------- classes
def load_class(spec: str, flag: str = "--model") -> Any:
    """``"package.module:ClassName"`` (or a built-in name) to the class; an :class:`InputError` otherwise."""
    spec = BUILTIN_MODELS.get(spec, spec)
    if ":" not in spec:
        if "." in spec:  # a dotted path, as in a config's class_path
            module_name, _, attr = spec.rpartition(".")
        else:
            raise InputError(flag, f"{spec!r}: use 'package.module:ClassName' or a built-in name"
                                   f" ({', '.join(BUILTIN_MODELS)}).")
    else:
        module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        hint = ""
        if module_name.startswith("examples.") and getattr(err, "name", None) in ("examples", module_name):
            # the repository's examples are not in the installed package
            hint = (" The examples come with the source repository, not with the installed package: run from the"
                    " root of a checkout, or use the built-in 'gpt-mini'.")
        raise InputError(flag, f"{spec!r}: cannot import {module_name!r} ({err}).{hint}") from None
    try:
        return getattr(module, attr)
    except AttributeError:
        close = difflib.get_close_matches(attr, [n for n in dir(module) if not n.startswith("_")], n=1)
        hint = f" Did you mean {module_name}:{close[0]}?" if close else ""
        raise InputError(flag, f"{spec!r}: {module_name!r} has no {attr!r}.{hint}") from None


def accepted_args(cls: Any) -> Optional[list[str]]:
    """The constructor's argument names, or ``None`` when it takes ``**kwargs`` (anything goes)."""
    try:
        params = inspect.signature(cls).parameters
    except (TypeError, ValueError):
        return None
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return None
    return [n for n, p in params.items() if p.kind not in (p.VAR_POSITIONAL,)]


def check_args(cls: Any, names: list[str], flag: Callable[[str], str], shown: Optional[list[str]] = None) -> None:
    """Raise an :class:`InputError` for the first name ``cls`` does not take: its flag, the accepted names
    (``shown``, if given, instead of all of them)."""
    accepted = accepted_args(cls)
    if accepted is None:
        return
    for name in names:
        if name not in accepted:
            close = difflib.get_close_matches(name, accepted, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            listed = ", ".join(shown if shown is not None else accepted) or "none"
            raise InputError(flag(name), f"unknown argument {name!r} for {cls.__name__}; accepted: {listed}{hint}")


def _check_model_class(cls: Any, flag: str, spec: str) -> None:
    from lightning.pytorch import LightningModule

    if not (isinstance(cls, type) and issubclass(cls, LightningModule)):
        raise InputError(flag, f"{spec!r} is not a LightningModule class")


def parse_json_args(text: str, flag: str) -> dict[str, Any]:
    """A JSON object of keyword arguments; an :class:`InputError` naming the flag and the value otherwise."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise InputError(flag, f"{text!r} is not valid JSON ({err.msg} at character {err.pos}); write an object"
                               ' with double-quoted names, e.g. \'{"width": 512}\', or use --model.width 512') from None
    if not isinstance(value, dict):
        raise InputError(flag, f"{text!r} is not a JSON object; write e.g. '{{\"width\": 512}}'")
    return value


def parse_dotted(extras: list[str]) -> dict[str, dict[str, tuple[str, str]]]:
    """``--model.width 512 --trainer.gradient_clip_val=1`` to ``{"model": {"width": ("512", flag)}, ...}``.

    Accepted groups: ``model``, ``data``, ``trainer``. Values stay text (YAML, read later). Anything else in
    ``extras`` is an :class:`InputError` ("unrecognized argument").
    """
    groups: dict[str, dict[str, tuple[str, str]]] = {"model": {}, "data": {}, "trainer": {}}
    i = 0
    while i < len(extras):
        token = extras[i]
        name, eq, value = token.partition("=")
        group, dot, key = name[2:].partition(".") if name.startswith("--") else ("", "", "")
        if not dot or group not in groups or not key:
            raise InputError(token, "unrecognized argument (see --help; constructor arguments are --model.NAME VALUE,"
                                    " --data.NAME VALUE, --trainer.NAME VALUE)")
        if not eq:
            if i + 1 >= len(extras) or (extras[i + 1].startswith("--") and not _is_number(extras[i + 1])):
                raise InputError(name, "needs a value, e.g. --model.width 512")
            value = extras[i + 1]
            i += 1
        groups[group][key] = (value, name)
        i += 1
    return groups


def _is_number(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False


def _yaml_value(text: str, flag: str) -> Any:
    import yaml

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise InputError(flag, f"{text!r} is not a valid value ({str(err).splitlines()[0]})") from None


# --------------------------------------------------------------------------------------------- the spec
@dataclass
class Spec:
    """What to train, once per mode: ``build()`` returns a fresh ``(module, datamodule or None)``."""

    name: str
    model_cls: Any
    build: Callable[[], tuple[Any, Any]]
    describe: str
    trainer_kwargs: dict[str, Any] = field(default_factory=dict)
    plugin_kwargs: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    seed: Optional[int] = None
    flag: str = "--model"  # the flag to blame when building the model fails


def make_spec(model: Optional[str], model_args: str, datamodule: Optional[str], datamodule_args: str,
              config: Optional[str], extras: list[str], device_type: str) -> Spec:
    """The :class:`Spec` of the flags (see the module's docstring)."""
    dotted = parse_dotted(extras)
    model_json = parse_json_args(model_args, "--model-args")
    dm_json = parse_json_args(datamodule_args, "--datamodule-args")
    if config is not None:
        return _spec_from_config(config, model, model_json, datamodule, dm_json, dotted, device_type)
    name = model or "gpt-mini"
    model_cls = load_class(name, "--model")
    _check_model_class(model_cls, "--model", name)
    check_args(model_cls, list(model_json), lambda n: "--model-args")
    check_args(model_cls, list(dotted["model"]), lambda n: dotted["model"][n][1])
    model_kwargs = dict(builtin_size(device_type)) if name == "gpt-mini" else {}
    model_kwargs.update(model_json)
    model_kwargs.update({k: _yaml_value(v, f) for k, (v, f) in dotted["model"].items()})
    dm_name = datamodule or BUILTIN_DATAMODULES.get(name)
    dm_cls = load_class(dm_name, "--datamodule") if dm_name else None
    if dm_cls is None and (dm_json or dotted["data"]):
        flag = "--datamodule-args" if dm_json else next(iter(dotted["data"].values()))[1]
        raise InputError(flag, "data arguments need a data module: add --datamodule pkg.mod:DataModule")
    dm_kwargs: dict[str, Any] = {}
    if dm_cls is not None:
        check_args(dm_cls, list(dm_json), lambda n: "--datamodule-args")
        check_args(dm_cls, list(dotted["data"]), lambda n: dotted["data"][n][1])
        dm_kwargs = {**dm_json, **{k: _yaml_value(v, f) for k, (v, f) in dotted["data"].items()}}
    trainer_given = {k: _yaml_value(v, f) for k, (v, f) in dotted["trainer"].items()}
    _check_trainer_args(trainer_given, {k: f for k, (v, f) in dotted["trainer"].items()})
    trainer_kwargs, left_out = filter_trainer_args(trainer_given)
    notes = describe_setup(trainer_kwargs, left_out, [])

    def build() -> tuple[Any, Any]:
        return model_cls(**model_kwargs), (dm_cls(**dm_kwargs) if dm_cls is not None else None)

    flag = "--model-args" if model_json else next((f for _, f in dotted["model"].values()), "--model")
    shown = _with_size_defaults(model_cls, model_kwargs) if name == "gpt-mini" else model_kwargs
    return Spec(name=name, model_cls=model_cls, build=build, describe=_call(model_cls, shown),
                trainer_kwargs=trainer_kwargs, notes=notes, flag=flag)


def _with_size_defaults(cls: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The built-in model's size arguments, defaults included, so the report shows what ran."""
    params = inspect.signature(cls).parameters
    sizes = {k: params[k].default for k in ("width", "layers", "heads", "seq_len", "batch_size") if k in params}
    return {**sizes, **kwargs}


def _call(cls: Any, kwargs: dict[str, Any]) -> str:
    return f"{getattr(cls, '__name__', cls)}({', '.join(f'{k}={v!r}' for k, v in kwargs.items())})"


def _check_trainer_args(given: dict[str, Any], flags: dict[str, str]) -> None:
    from lightning.pytorch import Trainer

    check_args(Trainer, list(given), lambda n: flags[n], shown=[*KEPT_TRAINER_ARGS, "..."])


def filter_trainer_args(given: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """Split a user's Trainer arguments into those kept (:data:`KEPT_TRAINER_ARGS`, a single-device strategy) and
    the non-default rest that compare does not apply (``"name=value"``; :data:`SILENT_TRAINER_ARGS` unlisted)."""
    from lightning.pytorch import Trainer

    defaults = {n: p.default for n, p in inspect.signature(Trainer).parameters.items()}
    kept: dict[str, Any] = {}
    left_out: list[str] = []
    for key, value in given.items():
        if key in KEPT_TRAINER_ARGS:
            if key not in defaults or not _same(value, defaults[key]):
                kept[key] = value
        elif key in SILENT_TRAINER_ARGS or (key in defaults and _same(value, defaults[key])):
            continue
        elif key == "strategy" and value in SINGLE_DEVICE_STRATEGIES:
            continue
        elif key in ("devices", "num_nodes") and value in (1, "1", "auto", [0]):
            continue
        elif key in ("callbacks", "plugins") and not value:
            continue
        else:
            left_out.append(f"{key}={_short(value)}")
    return kept, left_out


def describe_setup(kept: dict[str, Any], left_out: list[str], plugin_notes: list[str]) -> list[str]:
    """The lines that say what of the user's setup is used: kept Trainer settings, MPPlugin settings, left out."""
    notes = []
    if kept:
        notes.append("kept: " + ", ".join(f"{k}={v!r}" for k, v in kept.items()))
    notes += plugin_notes
    if left_out:
        notes.append("not applied (each mode runs on one device with its own MPPlugin, PrecisionMonitor and timer,"
                     " for --steps steps): " + ", ".join(left_out))
    return notes


def _same(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - incomparable values differ
        return False


def _short(value: Any) -> str:
    if isinstance(value, list):
        return "[" + ", ".join(_short(v) for v in value) + "]"
    path = _class_path(value)
    if path:
        return path.rsplit(".", 1)[-1]
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _class_path(entry: Any) -> Optional[str]:
    try:
        if "class_path" in entry:
            return str(entry["class_path"])
    except TypeError:
        pass
    return None


# --------------------------------------------------------------------------------------------- --config
def _spec_from_config(path: str, model: Optional[str], model_json: dict[str, Any], datamodule: Optional[str],
                      dm_json: dict[str, Any], dotted: dict[str, dict[str, tuple[str, str]]],
                      device_type: str) -> Spec:
    data, modified, notes = _read_config(path)
    model_cls, subclass_model, model, data, modified = _config_model(path, data, modified, notes, model, model_json,
                                                                     dotted, device_type)
    dm_cls, subclass_data = _config_data(path, data, datamodule, model, dm_json, dotted)
    trainer_section = data.get("trainer") or {}
    _check_trainer_args(trainer_section, {k: f"--config {path}: trainer.{k}" for k in trainer_section})
    _check_trainer_args(dict(dotted["trainer"]), {k: f for k, (v, f) in dotted["trainer"].items()})

    # the file as LightningCLI reads it, and the flags on top (they win)
    args = ["--config", _as_file(data, path) if modified else path]
    args += [f"--model.{k}={json.dumps(v)}" for k, v in model_json.items()]
    args += [f"--data.{k}={json.dumps(v)}" for k, v in dm_json.items()]
    args += [f"--{group}.{k}={v}" for group in ("model", "data", "trainer") for k, (v, _) in dotted[group].items()]
    cli = _build_cli(model_cls, subclass_model, dm_cls, subclass_data, args, path)
    trainer_config = _namespace_dict(cli.config.get("trainer"))
    plugin_kwargs, plugin_notes, other_plugins = _plugin_settings(trainer_config.get("plugins"))
    trainer_kwargs, left_out = filter_trainer_args(
        {k: v for k, v in trainer_config.items() if k not in ("plugins", "precision")})
    if trainer_config.get("precision") is not None:
        left_out.insert(0, f"precision={trainer_config['precision']!r}")
    notes += describe_setup(trainer_kwargs, other_plugins + left_out, plugin_notes)
    seed = cli.config.get("seed_everything")

    def build() -> tuple[Any, Any]:
        from lightning_mp.tools.cli import CLIConfigError

        try:
            cli.instantiate_classes()
        except CLIConfigError as err:
            raise InputError("--config", f"{path}: {err}") from None
        return cli.model, cli.datamodule

    described = _namespace_dict(cli.config.get("model"))
    if subclass_model:
        described = _namespace_dict(described.get("init_args"))
    return Spec(name=str(model or (data.get("model") or {}).get("class_path")), model_cls=model_cls, build=build,
                describe=_call(model_cls, _non_default(model_cls, described)), trainer_kwargs=trainer_kwargs,
                plugin_kwargs=plugin_kwargs, notes=notes,
                seed=seed if isinstance(seed, int) and not isinstance(seed, bool) else None, flag="--config")


def _read_config(path: str) -> tuple[dict[str, Any], bool, list[str]]:
    """The --config file read and checked as a fit config: ``(its sections, modified, notes)``."""
    import yaml

    try:
        with open(path) as f:
            data = yaml.safe_load(f)
    except OSError as err:
        raise InputError("--config", f"{path!r}: cannot read it ({err.strerror})") from None
    except yaml.YAMLError as err:
        raise InputError("--config", f"{path!r} is not valid YAML ({' '.join(str(err).split())})") from None
    data = {} if data is None else data
    if not isinstance(data, dict):
        raise InputError("--config", f"{path!r}: a Lightning CLI config is a mapping (trainer:, model:, data:)")
    notes: list[str] = []
    modified = False
    if isinstance(data.get("fit"), dict):  # a whole-CLI config: the fit subcommand's section
        data, modified = data["fit"], True
    for key in ("ckpt_path", "subcommand"):
        if key in data:
            data, modified = {k: v for k, v in data.items() if k != key}, True
            notes.append(f"{key}: not applied")
    unknown = [k for k in data if k not in ("trainer", "model", "data", "seed_everything", "optimizer",
                                              "lr_scheduler")]
    if unknown:
        raise InputError("--config", f"{path!r}: unknown section {unknown[0]!r}; a fit config has trainer, model,"
                                     " data, optimizer, lr_scheduler and seed_everything")
    for section in ("trainer", "model", "data"):
        if data.get(section) is not None and not isinstance(data[section], dict):
            raise InputError("--config", f"{path!r}: the {section} section is not a mapping")
    return data, modified, notes


def _config_model(path: str, data: dict[str, Any], modified: bool, notes: list[str], model: Optional[str],
                  model_json: dict[str, Any], dotted: dict[str, dict[str, tuple[str, str]]],
                  device_type: str) -> tuple[Any, bool, Optional[str], dict[str, Any], bool]:
    """The config's model class (the section's class_path, else --model; default: the built-in GPT-mini, sized to
    the device), its arguments checked: ``(class, subclass mode, --model as settled, data, modified)``."""
    model_section = data.get("model") or {}
    subclass_model = "class_path" in model_section
    if subclass_model:
        model_cls = load_class(str(model_section["class_path"]), "--config")
        _check_model_class(model_cls, "--config", str(model_section["class_path"]))
        model_args = dict(model_section.get("init_args") or {})
    else:
        if model_section and model is None:
            model = _builtin_for(model_section, data.get("data") or {})  # the repository's own example configs
            if model is None:
                raise InputError("--config", f"{path!r}: the model section has no class_path; name the class with"
                                             " --model pkg.mod:Class, or add class_path: to the model section")
            notes.append(f"model: {model} (the built-in model whose arguments the config's model section names;"
                         " --model picks another)")
        model = model or "gpt-mini"
        model_cls = load_class(model, "--model")
        _check_model_class(model_cls, "--model", model)
        model_args = dict(model_section)
        if model == "gpt-mini":
            sized = builtin_size(device_type)
            if sized:
                data, modified = {**data, "model": {**sized, **model_args}}, True
    check_args(model_cls, list(model_args), lambda n: f"--config {path}: model.{n}")
    check_args(model_cls, list(model_json), lambda n: "--model-args")
    check_args(model_cls, list(dotted["model"]), lambda n: dotted["model"][n][1])
    return model_cls, subclass_model, model, data, modified


def _config_data(path: str, data: dict[str, Any], datamodule: Optional[str], model: Optional[str],
                 dm_json: dict[str, Any], dotted: dict[str, dict[str, tuple[str, str]]]) -> tuple[Any, bool]:
    """The config's data module class (the section's class_path, else --datamodule, or the built-in example's),
    its arguments checked: ``(class or None, subclass mode)``."""
    data_section = data.get("data") or {}
    subclass_data = "class_path" in data_section
    dm_cls = None
    if subclass_data:
        dm_cls = load_class(str(data_section["class_path"]), "--config")
        dm_args = dict(data_section.get("init_args") or {})
    else:
        dm_name = datamodule or BUILTIN_DATAMODULES.get(model or "")
        if data_section and dm_name is None:
            raise InputError("--config", f"{path!r}: the data section has no class_path; name the class with"
                                         " --datamodule pkg.mod:DataModule, or add class_path: to the data section")
        dm_cls = load_class(dm_name, "--datamodule") if dm_name else None
        dm_args = dict(data_section)
    if dm_cls is not None:
        check_args(dm_cls, list(dm_args), lambda n: f"--config {path}: data.{n}")
        check_args(dm_cls, list(dm_json), lambda n: "--datamodule-args")
        check_args(dm_cls, list(dotted["data"]), lambda n: dotted["data"][n][1])
    elif dm_json or dotted["data"]:
        flag = "--datamodule-args" if dm_json else next(iter(dotted["data"].values()))[1]
        raise InputError(flag, "data arguments need a data module: add --datamodule or a data section")
    return dm_cls, subclass_data


def _builtin_for(model_section: dict[str, Any], data_section: dict[str, Any]) -> Optional[str]:
    """The one built-in model (with its data module) that takes every argument of a config's model and data sections
    without ``class_path``: the configs of the repository's examples (``examples/configs/gpt_mini_bf16.yaml``) name
    no class, their script does; ``None`` when none or several fit (the examples import from a source checkout)."""
    fits = []
    for name, spec in BUILTIN_MODELS.items():
        try:
            model_cls = load_class(spec, "--model")
            dm_spec = BUILTIN_DATAMODULES.get(name)
            dm_cls = load_class(dm_spec, "--datamodule") if dm_spec else None
        except InputError:  # not importable here (the examples outside a source checkout)
            continue
        model_args = accepted_args(model_cls)
        data_args = accepted_args(dm_cls) if dm_cls is not None else []
        if model_args is not None and not set(model_section) <= set(model_args):
            continue
        if data_section and data_args is not None and not set(data_section) <= set(data_args):
            continue
        fits.append(name)
    return fits[0] if len(fits) == 1 else None


def _as_file(data: dict[str, Any], path: str) -> str:
    """A copy of the (changed) config for jsonargparse, next to the original so relative paths still resolve."""
    import atexit

    import yaml

    try:
        handle, copy = tempfile.mkstemp(prefix=".compare-", suffix=".yaml", dir=os.path.dirname(os.path.abspath(path)))
    except OSError:
        handle, copy = tempfile.mkstemp(prefix="compare-", suffix=".yaml")
    with os.fdopen(handle, "w") as f:
        yaml.safe_dump(data, f, sort_keys=False)
    atexit.register(lambda: os.remove(copy) if os.path.exists(copy) else None)
    return copy


def _build_cli(model_cls: Any, subclass_model: bool, dm_cls: Any, subclass_data: bool, args: list[str], path: str):
    try:
        import jsonargparse  # noqa: F401 - a clear message when missing
    except ImportError:
        raise InputError("--config", "reading a Lightning CLI config needs jsonargparse, which comes with the cli"
                                     ' extra: pip install "lightning-mp[cli]"') from None
    from lightning.pytorch import LightningDataModule, LightningModule

    from lightning_mp.tools.cli import CLIConfigError, MPLightningCLI

    class CompareCLI(MPLightningCLI):
        """Parses and builds the model and the data; each mode builds its own Trainer."""

        def instantiate_trainer(self, **kwargs: Any) -> Any:
            return None

    try:
        return CompareCLI(
            model_class=LightningModule if subclass_model else model_cls,
            datamodule_class=(LightningDataModule if subclass_data else dm_cls),
            subclass_mode_model=subclass_model,
            subclass_mode_data=subclass_data,
            run=False,
            args=args,
            save_config_callback=None,
            parser_kwargs={"exit_on_error": False},
            seed_everything_default=False,
        )
    except CLIConfigError as err:
        raise InputError("--config", f"{path}: {err}") from None
    except SystemExit:  # jsonargparse exits on some errors regardless
        raise InputError("--config", f"{path}: jsonargparse could not read it (see above)") from None


def _namespace_dict(value: Any) -> dict[str, Any]:
    if value is None:
        return {}
    if hasattr(value, "as_dict"):
        return value.as_dict()
    return dict(value) if isinstance(value, dict) else {}


def _non_default(cls: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    try:
        params = inspect.signature(cls).parameters
    except (TypeError, ValueError):
        return kwargs
    return {k: v for k, v in kwargs.items() if k not in params or not _same(params[k].default, v)}


def _plugin_settings(plugins: Any) -> tuple[dict[str, Any], list[str], list[str]]:
    """The non-default settings of an ``MPPlugin`` in ``trainer.plugins`` (every mode gets them), a note on them,
    and the other plugins (not applied)."""
    entries = plugins if isinstance(plugins, list) else ([plugins] if plugins else [])
    kwargs: dict[str, Any] = {}
    notes: list[str] = []
    others: list[str] = []
    for entry in entries:
        entry = entry if isinstance(entry, dict) else _namespace_dict(entry)
        path = str(entry.get("class_path", ""))
        if path.rsplit(".", 1)[-1] != "MPPlugin":
            others.append(f"plugins: {_short(entry) if path else entry!r}")
            continue
        from lightning_mp import MPPlugin

        init_args = _namespace_dict(entry.get("init_args"))
        defaults = {n: p.default for n, p in inspect.signature(MPPlugin).parameters.items()}
        for key, value in init_args.items():
            if key in MODE_PLUGIN_ARGS or (key in defaults and _same(defaults[key], value)):
                continue
            kwargs[key] = value
        if kwargs:
            notes.append("MPPlugin settings for every mode: " + ", ".join(f"{k}={v!r}" for k, v in kwargs.items()))
    return kwargs, notes, others


def plugin_kwargs_for(mode: str, kwargs: dict[str, Any]) -> dict[str, Any]:
    """A config's MPPlugin settings that apply to ``mode`` (master weights to true-half modes, fp8 to fp8)."""
    from lightning_mp.modes import MODES

    precision = mode.partition(":")[0]
    spec = MODES.get(precision)
    out = dict(kwargs)
    if spec is None or not spec.true_half:
        out.pop("master_weights", None)
    if (mode.partition(":")[2] or out.get("master_weights")) in ("none", "optimizer", False, "false"):
        out.pop("optimizer_states", None)  # (the optimizer keeps those moments itself)
    if spec is None or not spec.fp8:
        out.pop("fp8", None)
    return out


# --------------------------------------------------------------------------------------------- batch size
def find_batch_size(module: Any, datamodule: Any) -> Optional[tuple[Any, int]]:
    """Where the batch size lives (``batch_size`` on the data module, the model, or their ``hparams``), and its
    value; ``None`` when neither has one (the batch probe is then skipped)."""
    for owner in (datamodule, module):
        if owner is None:
            continue
        for holder in (owner, getattr(owner, "hparams", None)):
            value = getattr(holder, "batch_size", None) if holder is not None else None
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return holder, value
    return None


def set_batch_size(module: Any, datamodule: Any, value: int) -> None:
    found = find_batch_size(module, datamodule)
    if found is not None:
        setattr(found[0], "batch_size", value)
