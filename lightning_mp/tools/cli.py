"""Lightning CLI with short configuration errors for precision plugins and callbacks.

``MPLightningCLI`` is a ``LightningCLI`` that turns jsonargparse's report on a bad ``trainer.plugins`` or
``trainer.callbacks`` entry (about 90 lines of "Does not validate against any of the Union subtypes",
the real cause buried inside) into one short message naming the entry, the argument, the value and the
accepted values, and that explains ``trainer.precision`` given together with a precision plugin::

    error: trainer.plugins[0]: lightning_mp.MPPlugin(precision='fp12') is invalid: Unknown precision 'fp12'.
    Accepted values: 'fp32', 'tf32', 'bf16', 'fp16', ...

Where the errors come from, and what is done with each:

- parse time (a value of the wrong type, a ``Literal`` value not in its list, an argument the class does not
  take, a ``class_path`` that cannot be imported): jsonargparse raises one ``ArgumentError`` whose text is a
  tree with one branch per member of the ``Union`` Lightning declares for ``plugins``/``callbacks``. The
  branch for the class the user named starts with ``Problem with given class_path '...'``; that branch is
  read, and the class's own signature gives the accepted values.
- instantiation (an exception raised by the class's ``__init__``, e.g. ``MPPlugin`` rejecting a precision
  name): jsonargparse reports it as "Not a valid subclass". The parsed entries are then built one by one
  to find the one that fails, and its exception's message is reported.
- ``trainer.precision`` plus a ``Precision`` plugin: checked before anything is built.
- a mode the machine cannot run (fp8 without its FP8 library or on a CPU, bf16 on a pre-Ampere GPU):
  checked with :func:`lightning_mp.modes.resolve_mode` once the Trainer knows its device, before any data
  or model is set up.

Errors it does not recognise are passed on unchanged (without jsonargparse's usage dump; the full report
stays in :attr:`CLIConfigError.details`).

jsonargparse comes with the ``cli`` extra (``pip install "lightning-mp[cli]"``): ``import lightning_mp`` and the
plugin never need it, so importing this module without it fails with a message naming the extra.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import importlib
import inspect
import pkgutil
import re
import sys
import typing

import torch
from argparse import ArgumentError
from typing import Any, Literal, Optional, Union

import yaml

# jsonargparse is the `cli` extra; checked before Lightning's CLI module, which imports it too where installed
try:
    from jsonargparse import Namespace
except ImportError as err:
    if not isinstance(err, ModuleNotFoundError) or (err.name or "").split(".")[0] != "jsonargparse":
        raise  # jsonargparse is there but broken (one of its own imports fails): its message says which
    raise ModuleNotFoundError(
        "MPLightningCLI (lightning_mp.tools.cli) needs jsonargparse, which is not installed; it comes with"
        " lightning-mp's `cli` extra: pip install \"lightning-mp[cli]\"",
        name="jsonargparse",
    ) from err

from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.plugins.precision import Precision

__all__ = [
    "CLIConfigError",
    "MPLightningCLI",
    "cli_signature_problems",
    "precision_conflict",
    "short_instantiation_error",
    "short_parse_error",
    "unrunnable_precision",
]

# entries of these Trainer arguments are diagnosed; each is a class_path entry or a list of them
_ENTRY_KEYS = ("plugins", "callbacks")
# types a Lightning CLI maps one-to-one onto YAML without surprises (STYLE.md)
_PLAIN = (str, int, float, bool, type(None))


class CLIConfigError(ValueError):
    """A configuration error, in short. ``details`` keeps jsonargparse's full report.

    Example::

        try:
            MPLightningCLI(MyModel, args=["fit", "--config", "bad.yaml"], parser_kwargs={"exit_on_error": False})
        except CLIConfigError as err:
            print(err)           # trainer.plugins[0]: lightning_mp.MPPlugin(precision='fp12') is invalid: ...
            print(err.details)   # the original report
    """

    def __init__(self, message: str, details: str = "") -> None:
        super().__init__(message)
        self.details = details


class MPLightningCLI(LightningCLI):
    """``LightningCLI`` whose errors about ``trainer.plugins``, ``trainer.callbacks`` and ``trainer.precision``
    are short and say how to fix them. Same arguments as ``LightningCLI``.

    Example::

        # train.py
        from lightning_mp.tools.cli import MPLightningCLI
        MPLightningCLI(MyModel, MyDataModule)

        # python train.py fit --config bf16.yaml
        # python train.py fit --trainer.plugins=lightning_mp.MPPlugin --trainer.plugins.precision=fp16

    A bad value prints ``error: <one short message>`` and exits with status 2, as argparse does. With
    ``parser_kwargs={"exit_on_error": False}`` it raises :class:`CLIConfigError` instead.
    """

    def init_parser(self, **kwargs: Any) -> LightningArgumentParser:
        # the parsers raise, so that the errors can be shortened here; exiting is decided in _fail
        kwargs["exit_on_error"] = False
        return super().init_parser(**kwargs)

    @property
    def _exits_on_error(self) -> bool:
        return bool(self.parser_kwargs.get("exit_on_error", True))

    def parse_arguments(self, parser: LightningArgumentParser, args: Any) -> None:
        try:
            super().parse_arguments(parser, args)
        except ArgumentError as err:
            text = str(err)
            self._fail(short_parse_error(text) or _trim_report(text), text)

    def before_instantiate_classes(self) -> None:
        super().before_instantiate_classes()
        message = precision_conflict(self._trainer_config())
        if message is not None:
            self._fail(message)

    def instantiate_classes(self) -> None:
        try:
            super().instantiate_classes()
        except Exception as err:  # noqa: BLE001 - only replaced when an entry is found to be the cause
            message = short_instantiation_error(self._trainer_config())
            if message is None:
                raise
            self._fail(message, str(err))

    def after_instantiate_classes(self) -> None:
        super().after_instantiate_classes()
        if self.subcommand is not None:
            message = unrunnable_precision(self.trainer)
            if message is not None:
                self._fail(message)

    def _trainer_config(self) -> Namespace:
        config = self.config
        subcommand = config.get("subcommand")
        if subcommand:
            config = config[subcommand]
        return config.get("trainer") or Namespace()

    def _fail(self, message: str, details: str = "") -> typing.NoReturn:
        if self._exits_on_error:
            sys.stderr.write(f"error: {message}\n")
            sys.exit(2)
        raise CLIConfigError(message, details) from None


# ---------------------------------------------------------------------------------------------- parse time
_PROBLEM = re.compile(r"^(?P<indent>\s*)(?:- )?Problem with given class_path '(?P<path>[^']+)':\s*$")
_KEY = re.compile(r'^Parser key "(?P<key>[^"]+)":\s*$')
# jsonargparse 4.42+: "Option 'x' is not accepted"; 4.39-4.41: "Validation failed: Key 'x' is not expected"
_UNKNOWN = re.compile(r"^(?:Validation failed: )?(?:Option|Key) '(?P<arg>[^']+)' is not (?:accepted|expected)")
_VALUE = re.compile(r"(?:Got value|Given value): (?P<value>.*)$")
# a command-line value (``--trainer.callbacks.action=explode``) as the report gives it at the end; jsonargparse
# 4.39-4.41 leave it out of the entry's own branch ("Cannot take a Union of no types.")
_NESTED = re.compile(r"Given value: NestedArg\(key='(?P<key>[^']+)', val=(?P<val>.*)\)\s*$")


def short_parse_error(message: str) -> Optional[str]:
    """One short message for a jsonargparse parse error about a class_path entry, or ``None``.

    Example::

        short_parse_error(str(argument_error))
        # "trainer.plugins: lightning_mp.MPPlugin(hysteresis='two') is invalid: hysteresis takes an integer."
    """
    lines = message.splitlines()
    if not lines:
        return None
    top = _KEY.match(lines[0].strip())
    where = top.group("key") if top else "config"
    problems = _class_path_problems(lines)
    if problems:
        path, detail = _pick_problem(problems)
        return _explain_problem(where, path, detail, _command_line_values(lines))
    if top and len(lines) <= 4:
        # a plain argument (model.*, data.*, trainer.max_steps, ...): already short, say it plainly
        body = " ".join(line.strip() for line in lines[1:] if line.strip())
        return f"{where}: {_plain_expected(body)}"
    if top and where.split(".")[-1] in _ENTRY_KEYS:
        given = [m.group("value") for m in map(_VALUE.search, lines) if m]
        value = given[-1] if given else "?"
        return f"{where}: cannot use {value!r}. Each entry needs a class_path, e.g. {_entry_example(where)}."
    return None


def _command_line_values(lines: list[str]) -> dict[str, str]:
    values = {}
    for m in filter(None, map(_NESTED.search, lines)):
        try:
            values[m.group("key")] = str(ast.literal_eval(m.group("val")))
        except (ValueError, SyntaxError):
            values[m.group("key")] = m.group("val")
    return values


def _entry_example(where: str) -> str:
    if where.endswith("callbacks"):
        return "{class_path: lightning.pytorch.callbacks.LearningRateMonitor, init_args: {logging_interval: step}}"
    return "{class_path: lightning_mp.MPPlugin, init_args: {precision: bf16}}"


def _class_path_problems(lines: list[str]) -> list[tuple[str, list[str]]]:
    problems = []
    for i, line in enumerate(lines):
        m = _PROBLEM.match(line)
        if not m:
            continue
        indent = len(m.group("indent"))
        detail = []
        for nxt in lines[i + 1 :]:
            if nxt.strip() and len(nxt) - len(nxt.lstrip()) <= indent:
                break
            detail.append(nxt)
        width = min((len(d) - len(d.lstrip()) for d in detail if d.strip()), default=0)
        problems.append((m.group("path"), [d[width:] for d in detail if d.strip()]))
    return problems


def _pick_problem(problems: list[tuple[str, list[str]]]) -> tuple[str, list[str]]:
    # the union also tries Lightning's base classes (an implicit class_path); the user's class is the cause
    specific = [p for p in problems if not _is_union_base(_import_class(p[0]))]
    return (specific or problems)[0]


def _is_union_base(cls: Optional[type]) -> bool:
    from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
    from lightning.pytorch import Callback
    from lightning.pytorch.plugins import LayerSync

    return cls in (Precision, Callback, CheckpointIO, ClusterEnvironment, LayerSync)


def _explain_problem(where: str, path: str, detail: list[str], given: Optional[dict[str, str]] = None) -> str:
    first = detail[0].strip() if detail else ""
    cls = _import_class(path)
    if _is_union_base(cls):
        return f"{where}: an entry has no class_path. Each entry needs one, e.g. {_entry_example(where)}."
    if cls is None:
        reason = first or "not importable"
        return f"{where}: cannot import class_path {path!r} ({reason}).{_did_you_mean_class(path)}"
    key = _KEY.match(first)
    if key:
        arg = key.group("key")
        values = [m.group("value") for m in map(_VALUE.search, detail) if m]
        if not values and given and arg in given:
            values = [given[arg]]
        value = _fmt(_load_scalar(values[-1])) if values else "?"
        accepted = _describe(_parameter_types(cls).get(arg, inspect.Parameter.empty))
        return f"{where}: {path}({arg}={value}) is invalid: {arg} takes {accepted}."
    unknown = _UNKNOWN.match(first)
    if unknown:
        arg = unknown.group("arg")
        names = list(_parameter_types(cls))
        close = difflib.get_close_matches(arg, names, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        return f"{where}: {path} has no argument {arg!r}.{hint} Its arguments: {', '.join(names) or 'none'}."
    return f"{where}: {path}: {' '.join(d.strip() for d in detail)}"


def _plain_expected(text: str) -> str:
    m = re.match(r"Expected a (?P<type>.+?)\. Got value: (?P<value>.*)$", text)
    if not m:
        return text
    return f"got {m.group('value')!r}; accepted: {_describe_type_text(m.group('type'))}."


def _describe_type_text(text: str) -> str:
    lit = re.match(r"typing\.Literal\[(.*)\]$", text)
    if lit:
        return lit.group(1)
    named = re.match(r"<class '(\w+)'>$", text)
    if named:
        return _describe({"int": int, "float": float, "bool": bool, "str": str}.get(named.group(1), named.group(1)))
    return text


# ------------------------------------------------------------------------------------------ instantiation
def short_instantiation_error(trainer_config: Namespace) -> Optional[str]:
    """Build each ``plugins``/``callbacks`` entry of a parsed trainer config; describe the first that fails.

    Returns ``None`` when every entry builds, so the caller re-raises the original error.
    """
    for key in _ENTRY_KEYS:
        for index, entry in _entries(trainer_config.get(key)):
            path, init_args = _class_path_and_args(entry)
            cls = _import_class(path) if path else None
            if cls is None or any(isinstance(v, (Namespace, dict)) and "class_path" in v for v in init_args.values()):
                continue  # nested classes: leave the diagnosis to jsonargparse's report
            try:
                cls(**init_args)
            except Exception as err:  # noqa: BLE001 - any failure of the user's entry is what we report
                shown = f"trainer.{key}{index}: {path}({_shown_args(cls, init_args, str(err))})"
                if isinstance(err, (ValueError, TypeError)):
                    return f"{shown} is invalid: {str(err).strip()}"
                return f"{shown} failed: {type(err).__name__}: {str(err).strip()}"
    return None


def _shown_args(cls: type, init_args: dict[str, Any], error_text: str) -> str:
    # the arguments the error is about: those whose value it quotes, else those it names, else the non-defaults (a
    # default the error quotes among the accepted values, as optimizer_states' 'fp32', is not what it is about)
    defaults = {k: p.default for k, p in _signature_parameters(cls).items()}
    given = {k: v for k, v in init_args.items() if k not in defaults or defaults[k] != v}
    named = [k for k, v in given.items() if _mentions(error_text, v)]
    if not named:
        named = [k for k in init_args if re.search(rf"\b{re.escape(k)}\b", error_text)]
    if not named:
        named = list(given)
    return ", ".join(f"{k}={_show(init_args[k], error_text)!r}" for k in named)


def _show(value: Any, error_text: str) -> Any:
    # a nested mapping (e.g. MPPlugin's fp8 settings, expanded with every default): the keys the error names
    if isinstance(value, dict):
        named = {k: v for k, v in value.items() if re.search(rf"\b{re.escape(str(k))}\b", error_text)}
        return named or value
    return value


def _mentions(text: str, value: Any) -> bool:
    if isinstance(value, str) and value:
        return repr(value) in text or f"={value}" in text
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return f"={value!r}" in text
    return False


# -------------------------------------------------------------------------------- trainer.precision conflict
def precision_conflict(trainer_config: Namespace) -> Optional[str]:
    """Explain ``trainer.precision`` set together with a precision plugin (or two precision plugins).

    Example::

        precision_conflict(cli_config.fit.trainer)
        # "trainer.precision='bf16-mixed' and trainer.plugins[0]=lightning_mp.MPPlugin both set the precision ..."
    """
    plugins = []
    for index, entry in _entries(trainer_config.get("plugins")):
        path, init_args = _class_path_and_args(entry)
        cls = _import_class(path) if path else (type(entry) if isinstance(entry, Precision) else None)
        if isinstance(cls, type) and issubclass(cls, Precision):
            plugins.append((index, path or type(entry).__qualname__, init_args))
    if len(plugins) > 1:
        names = ", ".join(f"trainer.plugins{i}={p}" for i, p, _ in plugins)
        return f"{names}: more than one precision plugin; Lightning accepts one. Keep one of them."
    precision = trainer_config.get("precision")
    if precision is None or not plugins:
        return None
    index, path, init_args = plugins[0]
    suggestion = ""
    if path.split(".")[-1] == "MPPlugin":
        from lightning_mp.modes import parse_precision

        try:
            mode = parse_precision(precision)
        except ValueError:
            mode = None
        if mode is not None and mode != init_args.get("precision", mode):
            suggestion = (
                f" They disagree: trainer.precision={precision!r} means precision: {mode}, the plugin has"
                f" precision: {init_args.get('precision')}."
            )
        elif mode is not None:
            suggestion = f" Set the mode on the plugin instead: init_args: {{precision: {mode}}}."
    return (
        f"trainer.precision={precision!r} and trainer.plugins{index}={path} both set the precision, and Lightning"
        f" accepts only one.{suggestion} Remove trainer.precision (delete the line or write precision: null in"
        " the YAML file; on the command line, --trainer.precision=null)."
    )


# ------------------------------------------------------------------------------------ the machine's turn
def unrunnable_precision(trainer: Any) -> Optional[str]:
    """Whether the Trainer's device can run an ``MPPlugin`` mode (fp8 without its FP8 library, bf16 on a pre-Ampere
    GPU), asked before any data or model is set up; ``None`` when it can or the plugin is not an ``MPPlugin``."""
    plugin = trainer.precision_plugin
    requested = getattr(plugin, "requested_precision", None)
    if not isinstance(requested, str):
        return None
    from lightning_mp.modes import resolve_mode

    device = trainer.strategy.root_device
    try:
        resolve_mode(requested, device.type)
    except Exception as err:  # noqa: BLE001 - the mode's own message says why and what to use instead
        return f"trainer.plugins: {_public_path(type(plugin))}(precision={requested!r}) cannot run on {device}: {err}"
    return None


def _public_path(cls: type) -> str:
    package = cls.__module__.split(".")[0]
    top = sys.modules.get(package)
    if top is not None and getattr(top, cls.__name__, None) is cls:
        return f"{package}.{cls.__name__}"
    return f"{cls.__module__}.{cls.__qualname__}"


# ---------------------------------------------------------------------------------------- signature lint
def cli_signature_problems(cls: type) -> list[str]:
    """What in ``cls.__init__``'s signature a Lightning CLI would not map one-to-one onto YAML.

    Flags ``*args``/``**kwargs`` (jsonargparse pulls in the parent's parameters), missing annotations, and
    types other than str/int/float/bool/None, ``Optional``, ``Literal``, ``list``, ``tuple``, ``dict`` and
    dataclasses of those (``torch.dtype`` needs a dotted path in YAML, for instance).

    Example::

        assert cli_signature_problems(MPPlugin) == []
    """
    problems = []
    hints = _parameter_types(cls)
    for name, param in _signature_parameters(cls, keep_var=True).items():
        if param.kind in (param.VAR_KEYWORD, param.VAR_POSITIONAL):
            problems.append(f"{name}: *args/**kwargs (use explicit parameters with defaults)")
        elif param.default is param.empty:
            problems.append(f"{name}: no default")
        elif hints.get(name, param.empty) is param.empty:
            problems.append(f"{name}: no type annotation")
        elif not _is_plain(hints[name]):
            problems.append(f"{name}: type {hints[name]!r} is not a plain YAML type")
    return problems


def _is_plain(tp: Any) -> bool:
    if tp is Any:
        return False
    if tp in _PLAIN:
        return True
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is Literal:
        return all(isinstance(a, _PLAIN) for a in args)
    if origin is Union or type(tp).__name__ == "UnionType":
        return all(_is_plain(a) for a in args)
    if origin in (list, tuple, dict):
        return all(a is Ellipsis or _is_plain(a) for a in args)
    if isinstance(tp, type) and issubclass(tp, torch.amp.GradScaler):
        return True  # MixedPrecision's own scaler argument: class_path + init_args in YAML, as Lightning's
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):  # a nested mapping in YAML, field by field
        try:
            return all(_is_plain(t) for t in typing.get_type_hints(tp).values())
        except Exception:  # noqa: BLE001 - unresolvable field annotations are not plain
            return False
    return tp in (list, tuple, dict)


# -------------------------------------------------------------------------------------------- helpers
def _describe(tp: Any) -> str:
    """Accepted values of a type, in words a YAML user knows."""
    if tp is inspect.Parameter.empty or tp is Any:
        return "any value"
    if isinstance(tp, str):
        return tp
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is Literal:
        return "one of " + ", ".join(_fmt(a) for a in args)
    if origin is Union or type(tp).__name__ == "UnionType":
        parts = [_describe(a) for a in args if a is not type(None)]
        return " or ".join(parts) + (" or null" if type(None) in args else "")
    if origin in (list, tuple):
        return f"a list of {_describe(args[0])}" if args else "a list"
    if origin is dict or tp is dict:
        return "a mapping"
    words = {bool: "true or false", int: "an integer", float: "a number", str: "a string", type(None): "null"}
    if tp in words:
        return words[tp]
    if isinstance(tp, type):
        return f"a class_path entry for {tp.__module__}.{tp.__qualname__} or a subclass"
    return str(tp)


def _fmt(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value)


def _load_scalar(text: str) -> Any:
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def _signature_parameters(cls: type, keep_var: bool = False) -> dict[str, inspect.Parameter]:
    try:
        params = inspect.signature(cls).parameters
    except (TypeError, ValueError):
        return {}
    return {
        n: p for n, p in params.items() if keep_var or p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)
    }


def _parameter_types(cls: type[Any]) -> dict[str, Any]:
    params = _signature_parameters(cls)
    try:
        hints = typing.get_type_hints(cls.__init__)
    except Exception:  # noqa: BLE001 - an unresolvable annotation: fall back to the raw one
        hints = {}
    return {n: hints.get(n, p.annotation) for n, p in params.items()}


def _import_class(path: Optional[str]) -> Optional[type]:
    if not path:
        return None
    parts = path.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        try:
            for attr in parts[cut:]:
                obj = getattr(obj, attr)
        except AttributeError:
            return None
        return obj if isinstance(obj, type) else None
    return None


def _did_you_mean_class(path: str) -> str:
    module_name, _, name = path.rpartition(".")
    try:
        module = importlib.import_module(module_name)
    except ImportError:
        return ""
    # the same name one level down (lightning_mp.callbacks.PrecisionMonitor for lightning_mp.PrecisionMonitor)
    for info in pkgutil.iter_modules(getattr(module, "__path__", [])):
        if info.name.startswith("_"):
            continue
        try:
            sub = importlib.import_module(f"{module_name}.{info.name}")
        except Exception:  # noqa: BLE001 - a submodule that does not import is no suggestion
            continue
        if isinstance(getattr(sub, name, None), type):
            return f" Did you mean '{module_name}.{info.name}.{name}'?"
    candidates = [n for n in dir(module) if isinstance(getattr(module, n, None), type)]
    close = difflib.get_close_matches(name, candidates, n=1)
    return f" Did you mean '{module_name}.{close[0]}'?" if close else ""


def _entries(value: Any) -> list[tuple[str, Any]]:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [(f"[{i}]", v) for i, v in enumerate(value)]
    return [("", value)]


def _class_path_and_args(entry: Any) -> tuple[Optional[str], dict[str, Any]]:
    if isinstance(entry, str):
        return entry, {}
    if isinstance(entry, (Namespace, dict)) and "class_path" in entry:
        init_args = entry.get("init_args") or {}
        if isinstance(init_args, Namespace):
            init_args = init_args.as_dict()
        return entry["class_path"], dict(init_args)
    return None, {}


def _trim_report(text: str, limit: int = 12) -> str:
    lines = text.splitlines()
    if len(lines) <= limit:
        return text
    return "\n".join(lines[:limit] + [f"... ({len(lines) - limit} more lines of jsonargparse's report)"])
