"""FP8 at run time: Transformer Engine's autocast, the micro-batch weight cache, and FP8 scaling state in
checkpoints (the capability checks and the recipes are in :mod:`lightning_mp.fp8.support`).

Example (a plain loop; ``MPPlugin("fp8")`` wires the same calls to Lightning's hooks)::

    import torch
    from lightning_mp.fp8 import FP8Training

    fp8 = FP8Training({"recipe": "delayed"})
    fp8.convert(model, device="cuda")               # checks, swaps layers, logs what it converted
    fp8.watch_saturation()                          # an inf an FP8 cast would saturate raises a device flag
    opt = torch.optim.AdamW(model.parameters())     # after the swap: the TE modules own new parameters
    for x in batches:
        with torch.autocast("cuda", torch.bfloat16), fp8.autocast(training=True):
            loss = model(x)
        loss.backward()
        saturated = fp8.sentinel.take()             # > 0: an FP8 operand held inf/NaN (MPPlugin skips on the device)
        if saturated is None or not saturated.item():
            opt.step()
        opt.zero_grad()
        fp8.weights_updated()                       # FP8 weight casts cached across micro-batches expire
    torch.save({"model": model.state_dict(), "fp8": fp8.state_dict()}, "ckpt.pt")   # plain tensors only

Transformer Engine is imported only when FP8 actually runs; this module imports without it.

Checkpoints. TE keeps the delayed-scaling state (per module: ``scale`` and ``amax_history``, forward and
backward) in ``fp8_meta`` and serialises it as the module's ``_extra_state``: a ``uint8`` tensor holding a
Python pickle of a dict (the recipe object, CPU tensors, ints). ``torch.load(weights_only=True)`` accepts that
tensor, but the bytes inside are a pickle: TE 2.20 refuses to unpickle delayed-scaling extra state on load
unless ``NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE=1`` (arbitrary code on load), and a state dict with
``_extra_state`` keys no longer loads into the unconverted model (Lightning restores the weights before the
precision plugin converts the layers). So after :meth:`FP8Training.convert` the TE modules leave
``_extra_state`` out of ``state_dict()`` (and accept its absence on load), and the scaling state travels as
plain tensors in :meth:`FP8Training.state_dict` (MPPlugin's checkpoint entry): the model's state dict has the
same keys as the torch model, loads into it, and the whole checkpoint loads with ``weights_only=True``.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import warnings
from typing import Any, Callable, Optional, Union

import torch
from torch import Tensor, nn

from lightning_mp.fp8.config import FP8Config, settle_weights
from lightning_mp.fp8.convert import ConversionReport, apply_weights_dtype, convert_to_te
from lightning_mp.fp8.filters import ModuleFilterFn
from lightning_mp.fp8.primary import (
    install_primary_hooks,
    quantized_parameters,
    refresh_transposes,
    requantize_from_masters,
    seed_masters,
)
from lightning_mp.fp8.sentinel import SaturationSentinel
from lightning_mp.fp8.support import autocast_api, build_recipe, check_fp8_support, import_te, te_version

# where these lived before lightning_mp.fp8.support: importable from here as well
from lightning_mp.fp8.support import (  # noqa: F401
    FP8UnavailableError,
    fp8_device_problem,
    fp8_support_facts,
    fp8_support_problem,
    recipe_spec,
    te_installed,
)

log = logging.getLogger("lightning_mp.fp8")

STATE_FORMAT = 1


# --------------------------------------------------------------------------------------------- weight cache
class MicrobatchWeightCache:
    """Tells Transformer Engine modules whether a forward is the first since their weights last changed.

    Example::

        cache = MicrobatchWeightCache()
        cache.attach(model)            # a forward pre-hook on every module taking ``is_first_microbatch``
        cache.active = True            # in training forwards only
        ...                            # micro-batches: first forward of each module casts, the rest reuse
        cache.weights_updated()        # after each optimizer step

    TE casts a weight to FP8 on every forward unless told ``is_first_microbatch``: ``True`` casts and keeps
    the FP8 copy, ``False`` reuses it. With gradient accumulation the weights do not change between the
    micro-batches of one optimizer step, so one cast per step is enough. Tracking a version per module (not
    a flag per step) keeps it right when a module runs twice in one forward, and in manual optimization.
    A caller that passes ``is_first_microbatch`` itself wins. Costs: one Python hook call per TE module call,
    and the cached FP8 weights stay in memory between steps, which is why the cache is on only with
    accumulation (``cache_fp8_weights="auto"``).
    """

    def __init__(self) -> None:
        self.version = 0
        self.active = False
        self._seen: dict[int, int] = {}
        self._handles: list[Any] = []
        self.target: Optional[nn.Module] = None

    @property
    def attached(self) -> bool:
        return bool(self._handles)

    def attach(self, model: nn.Module) -> int:
        """Hook every submodule whose ``forward`` takes ``is_first_microbatch``; returns how many."""
        self.detach()
        self.target = model
        for module in model.modules():
            if "is_first_microbatch" not in _forward_parameters(type(module)):
                continue
            self._handles.append(module.register_forward_pre_hook(self._pre_forward, with_kwargs=True))
            self._handles.append(module.register_load_state_dict_post_hook(self._loaded))
        self.weights_updated()
        return len(self._handles) // 2

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._seen.clear()
        self.target = None

    def weights_updated(self) -> None:
        """The weights may have changed (an optimizer step, a load): the next forward of each module recasts."""
        self.version += 1

    def _loaded(self, module: nn.Module, incompatible_keys: Any) -> None:
        self.weights_updated()

    def _pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> Optional[tuple[tuple, dict]]:
        if not self.active or "is_first_microbatch" in kwargs or len(args) > 1:
            return None
        key = id(module)
        first = self._seen.get(key) != self.version
        if first:
            self._seen[key] = self.version
        return args, {**kwargs, "is_first_microbatch": first}


def _forward_parameters(cls: type[nn.Module]) -> tuple[str, ...]:
    try:
        return tuple(inspect.signature(cls.forward).parameters)
    except (TypeError, ValueError):
        return ()


# --------------------------------------------------------------------------------------------- scaling state
_STATE_TENSORS = (("scaling_fwd", "scale_fwd", "amax_history_fwd"), ("scaling_bwd", "scale_bwd", "amax_history_bwd"))
_PLAIN = (bool, int, float, str)
#: fp8_meta entries that point into this process's global amax buffers: never carried over (TE drops them too)
_PROCESS_LOCAL_KEYS = frozenset({"buffer_index_and_autocast_key", "global_fp8_buffer_pos_fwd_recompute"})


#: Transformer Engine module classes that run FP8 GEMMs (their inputs and output gradients are cast to FP8)
FP8_GEMM_MODULES = ("Linear", "LayerNormLinear", "LayerNormMLP", "GroupedLinear")


def fp8_gemm_modules(model: nn.Module) -> list[nn.Module]:
    """The Transformer Engine modules in ``model`` that run FP8 GEMMs (``te.Linear``, ``te.LayerNormLinear``...)."""
    return [m for m in model.modules() if _is_te_class(type(m), FP8_GEMM_MODULES)]


def _is_te_class(cls: type, names: Optional[tuple[str, ...]] = None) -> bool:
    """A Transformer Engine module class (of ``names``, when given), also through the subclass FSDP2's fully_shard
    makes on the fly for a module it shards itself."""
    return any(c.__module__.startswith("transformer_engine.") and (names is None or c.__name__ in names)
               for c in cls.__mro__)  # fmt: skip


def _is_delayed(recipe: Any) -> bool:
    check = getattr(recipe, "delayed", None)
    if callable(check):
        try:
            return bool(check())
        except TypeError:
            pass
    return type(recipe).__name__ == "DelayedScaling"


#: module-name parts that wrappers insert (FSDP's units, activation checkpointing, torch.compile): not in the names
_WRAPPER_PARTS = frozenset({"_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod"})


def named_modules_unwrapped(model: nn.Module) -> dict[str, nn.Module]:
    """``model``'s modules by the names the unwrapped model gives them: FSDP's ``_fsdp_wrapped_module``, activation
    checkpointing's and ``torch.compile``'s name parts are left out (a wrapped module takes its wrapper's name), so a
    state saved under FSDP loads on one device and back.

    Example::

        named_modules_unwrapped(fsdp_lightning_module)["gpt.blocks.0.fc1"]   # not "...0._fsdp_wrapped_module.fc1"
    """
    out: dict[str, nn.Module] = {}
    for fqn, module in model.named_modules():  # parents first: the wrapped module replaces its wrapper
        out[".".join(p for p in fqn.split(".") if p not in _WRAPPER_PARTS) if fqn else fqn] = module
    return out


def fp8_scaling_state(model: nn.Module) -> dict[str, dict[str, Any]]:
    """Delayed-scaling state of every TE module that has some, as plain CPU tensors and numbers.

    Example::

        state = fp8_scaling_state(model)
        state["blocks.0.fc1"]["amax_history_fwd"].shape   # (amax_history_len, 3)

    Stateless recipes (current, block, mxfp8) and modules that have not run in FP8 yet have none.
    """
    out: dict[str, dict[str, Any]] = {}
    for fqn, module in named_modules_unwrapped(model).items():
        meta = getattr(module, "fp8_meta", None)
        if not isinstance(meta, dict) or "scaling_fwd" not in meta or not _is_delayed(meta.get("recipe")):
            continue
        entry: dict[str, Any] = {}
        for key, scale_name, history_name in _STATE_TENSORS:
            if key in meta:
                entry[scale_name] = meta[key].scale.detach().to("cpu", copy=True)
                entry[history_name] = meta[key].amax_history.detach().to("cpu", copy=True)
        entry["extra"] = {
            k: v
            for k, v in meta.items()
            if k not in _PROCESS_LOCAL_KEYS
            and (isinstance(v, _PLAIN) or (isinstance(v, (list, tuple)) and all(isinstance(x, _PLAIN) for x in v)))
        }
        out[fqn] = entry
    return out


#: (meta key, tensor index in it, name): TE's forward meta holds input 0 and weight 1, the backward meta grad 0
_LAYER_TENSORS = (("scaling_fwd", 0, "input"), ("scaling_fwd", 1, "weight"), ("scaling_bwd", 0, "grad"))
_FP8_MAX = {"input": 448.0, "weight": 448.0, "grad": 57344.0}  # E4M3 forward, E5M2 gradients (HYBRID)


def _delayed_layer_tensors(meta: dict[str, Any]) -> list[tuple[str, float, Tensor, Tensor]]:
    """A layer's ``(tensor name, its format's maximum, scale, latest amax)`` from TE's delayed-scaling meta (device
    scalars, not read here)."""
    recipe = meta.get("recipe")
    e4m3 = "E4M3" in str(getattr(recipe, "fp8_format", "")) and "HYBRID" not in str(getattr(recipe, "fp8_format", ""))
    return [
        (name, 448.0 if e4m3 else _FP8_MAX[name], meta[key].scale[index], meta[key].amax_history[0, index])
        for key, index, name in _LAYER_TENSORS
        if key in meta
    ]


def fit_amax_history(history: Tensor, length: int) -> Tensor:
    """``history`` cut or zero-padded to ``length`` rows, as TE's ``adjust_amax_history_length`` does.

    Example::

        fit_amax_history(torch.ones(4, 3), 2).shape    # (2, 3): the first rows kept
    """
    rows = history.shape[0]
    if rows == length:
        return history
    if rows > length:
        return history[:length].clone()
    return torch.nn.functional.pad(history, (0, 0, 0, length - rows))


def load_fp8_scaling_state(model: nn.Module, state: dict[str, dict[str, Any]], recipe: Any) -> list[str]:
    """Write :func:`fp8_scaling_state`'s output back into the TE modules of ``model``; returns the names done.

    Example::

        load_fp8_scaling_state(model, saved, build_recipe(config))

    Mirrors TE's own ``set_extra_state`` without a pickle: set the recipe and the saved numbers, allocate
    the recipe state, copy scales and amax histories in place (the quantizers keep pointing at them).
    Histories of another length are cut or padded to the recipe's ``amax_history_len``.
    """
    done = []
    modules = named_modules_unwrapped(model)
    for fqn, entry in state.items():
        module: Any = modules.get(fqn)  # a Transformer Engine module, known by what it has
        meta = getattr(module, "fp8_meta", None)
        if module is None or not isinstance(meta, dict) or not hasattr(module, "init_fp8_meta_tensors"):
            continue
        meta.update({k: v for k, v in entry.get("extra", {}).items() if k not in _PROCESS_LOCAL_KEYS})
        meta.pop("global_fp8_buffer_pos_fwd_recompute", None)
        meta["recipe"] = recipe
        meta["fp8_checkpoint"] = True
        try:
            module.init_fp8_meta_tensors(recipe)
        except TypeError:  # TE 1.x: no recipe argument
            module.init_fp8_meta_tensors()
        with torch.no_grad():
            for key, scale_name, history_name in _STATE_TENSORS:
                if key not in meta or scale_name not in entry:
                    continue
                target = meta[key]
                target.scale.copy_(entry[scale_name].to(target.scale.device))
                history = fit_amax_history(entry[history_name], target.amax_history.shape[0])
                target.amax_history.copy_(history.to(target.amax_history.device))
        done.append(fqn)
    return done


def scaling_state_compat(saved: Optional[dict[str, Any]], current: dict[str, Any]) -> tuple[bool, Optional[str]]:
    """Whether a checkpoint's FP8 scaling state applies to the current recipe, and what to tell the user.

    Example::

        scaling_state_compat({"recipe": "delayed", ...}, FP8Config(recipe="current").recipe_settings())
        # (False, "... written with recipe='delayed' ... resumes with recipe='current' ...")

    Both arguments are :meth:`FP8Config.recipe_settings` dicts. Returns ``(restore, message)``: restore the
    saved amax histories and scales or not; a message (for a warning) when anything differs.
    """
    if not saved:
        return False, None
    was, now = saved.get("recipe"), current.get("recipe")
    if was != now:
        if now == "delayed":
            after = (
                "delayed scaling starts from scale 1 and an empty amax history and recalibrates over the first"
                f" {current.get('amax_history_len', 1024)} steps (the first steps may clip)"
            )
        else:
            after = f"recipe={now!r} computes its scales from the current tensors and needs no saved state"
        return False, (
            f"MPPlugin: the checkpoint's FP8 scaling state was written with recipe={was!r} and training resumes"
            f" with recipe={now!r}: the saved state does not apply and is dropped; {after}."
        )
    if now != "delayed":
        return False, None
    if saved.get("fp8_format") != current.get("fp8_format"):
        return False, (
            f"MPPlugin: the checkpoint's FP8 scales were computed for fp8_format={saved.get('fp8_format')!r} and"
            f" training resumes with fp8_format={current.get('fp8_format')!r}: the saved scales are dropped and"
            f" recalibrate over the first {current.get('amax_history_len')} steps."
        )
    changes = [
        f"{key} {saved.get(key)!r} -> {current.get(key)!r}"
        for key in ("amax_history_len", "margin", "amax_compute_algo")
        if saved.get(key) != current.get(key)
    ]
    if changes:
        return True, (
            "MPPlugin: FP8 delayed-scaling settings changed since the checkpoint (" + ", ".join(changes) + "):"
            " the saved scales and amax histories are restored (histories cut or zero-padded to the new length)"
            " and the next scale updates follow the new settings."
        )
    return True, None


def install_checkpoint_hooks(model: nn.Module) -> int:
    """Keep TE's pickled ``_extra_state`` out of ``state_dict()`` and accept its absence on load; returns how many.

    Example::

        install_checkpoint_hooks(model)
        assert not any(k.endswith("_extra_state") for k in model.state_dict())

    See the module docstring for why. The FP8 scaling state is saved by :func:`fp8_scaling_state` instead.
    """
    count = 0
    for module in model.modules():
        if not _is_te_class(type(module)):
            continue
        if type(module).get_extra_state is nn.Module.get_extra_state or module.__dict__.get("_mp_fp8_hooks"):
            continue
        module.register_state_dict_post_hook(_drop_extra_state)
        module.register_load_state_dict_pre_hook(_tolerate_missing_extra_state)
        module.__dict__["_mp_fp8_hooks"] = True
        count += 1
    return count


def _drop_extra_state(module: nn.Module, state_dict: dict, prefix: str, local_metadata: Any) -> None:
    state_dict.pop(prefix + "_extra_state", None)


def _tolerate_missing_extra_state(module: nn.Module, state_dict: dict, prefix: str, *args: Any) -> None:
    # an empty uint8 tensor is TE's own "no state" value: set_extra_state returns at once
    state_dict.setdefault(prefix + "_extra_state", torch.empty(0, dtype=torch.uint8))


# --------------------------------------------------------------------------------------------- everything together
class _FP8Region:
    """``te.autocast`` plus the weight cache's training flag, as one cheap class-based context manager."""

    __slots__ = ("_owner", "_training", "_ctx", "_was_active")

    def __init__(self, owner: "FP8Training", training: bool) -> None:
        self._owner, self._training = owner, training
        self._ctx: Any = None
        self._was_active = False

    def __enter__(self) -> None:
        owner = self._owner
        self._ctx = owner._te_autocast()
        self._ctx.__enter__()
        cache = owner.weight_cache
        self._was_active, cache.active = cache.active, self._training and cache.attached
        if self._training and owner._requantize:
            owner.requantize_weights()

    def __exit__(self, *exc: Any) -> None:
        self._owner.weight_cache.active = self._was_active
        self._ctx.__exit__(*exc)


class FP8Training:
    """FP8 training of one model through Transformer Engine: checks, layer swap, autocast, weight cache, state.

    Example::

        fp8 = FP8Training({"recipe": "current", "weights": "fp32"})
        report = fp8.convert(model, device="cuda")
        with torch.autocast("cuda", torch.bfloat16), fp8.autocast(training=True):
            loss = model(x)

    This is what ``MPPlugin("fp8")`` calls from Lightning's hooks (see the module docstring for a plain loop):
    :meth:`convert` from ``convert_module``, :meth:`check` and :meth:`configure_weight_cache` from ``connect``,
    :meth:`autocast` from the step contexts (inside bf16 autocast), :meth:`weights_updated` after each
    optimizer step, :meth:`state_dict`/:meth:`load_state_dict` with the plugin's own.

    Args:
        config: an :class:`FP8Config`, a dict of its fields, or ``None`` for the defaults.
    """

    def __init__(self, config: Union[FP8Config, dict[str, Any], None] = None) -> None:
        self.config = FP8Config.from_value(config)
        #: the dtype the model's weights are kept in. Used alone (a loop of the caller's), "auto" is fp32: no master
        #: weights of ours step there, so the weights themselves keep full precision (as ``convert_to_te``'s "auto");
        #: the plugins settle "auto" per strategy and master weights before they convert
        self.weights = "fp32" if self.config.weights == "auto" else settle_weights(self.config, sharded=False)
        self.report: Optional[ConversionReport] = None
        self.weight_cache = MicrobatchWeightCache()
        self._model: Optional[nn.Module] = None
        self._recipe: Any = None
        self._autocast_fn: Optional[Callable[[], Any]] = None
        self._pending: Optional[dict[str, Any]] = None
        #: finds inf/NaN that FP8 casts would saturate into finite values (see :mod:`lightning_mp.fp8.sentinel`)
        self.sentinel = SaturationSentinel()
        self._optimizers: list[Any] = []  # with FP8 primary weights: the optimizers holding their masters
        self._requantize = False  # FP8 primary weights are written from their masters at the next training step
        self._fp8_params: list[Tensor] = []  # the FP8 primary weights (weights="fp8")

    # ------------------------------------------------------------------ set-up
    name = "transformer_engine"

    @property
    def recipe(self) -> Any:
        """The Transformer Engine recipe object (built once, on first use; one object keeps TE's caches warm)."""
        if self._recipe is None:
            self._recipe = build_recipe(self.config)
        return self._recipe

    @property
    def model(self) -> Optional[nn.Module]:
        """The model :meth:`convert` swapped, if any."""
        return self._model

    def check(self, device: Union[str, torch.device]) -> None:
        """:func:`check_fp8_support` for this config's recipe."""
        check_fp8_support(device, self.config.recipe)

    def convert(
        self,
        model: nn.Module,
        device: Union[str, torch.device, None] = None,
        *,
        module_filter_fn: Optional[ModuleFilterFn] = None,
        announce: Optional[Callable[[str], None]] = None,
        cast_weights: bool = True,
    ) -> ConversionReport:
        """Check the hardware, swap the layers, set the weights dtype, install the checkpoint hooks.

        Args:
            model: converted in place; create the optimizer afterwards.
            device: the device training runs on (``None``: the current CUDA device); checked first.
            module_filter_fn: an extra ``(module, fqn) -> bool`` rule (torchao style).
            announce: where the one-line summary goes (e.g. Lightning's ``rank_zero_info``); ``None`` logs it
                at INFO on the ``lightning_mp.fp8`` logger. The module-by-module list is logged at DEBUG.
            cast_weights: with ``weights="bf16"``, cast the model's weights (outside FP32 guards) to bf16 here;
                ``False``: the new layers keep the old weights' fp32 values and the caller casts (the plugins do,
                keeping the exact fp32 values for the master weights).
        """
        device = torch.device(device) if device is not None else torch.device("cuda")
        self.check(device)
        te = import_te()
        self._autocast_fn = None
        report = convert_to_te(
            model,
            config=self.config,
            module_filter_fn=module_filter_fn,
            te=te,
            device=device if device.index is not None else None,
            announce=announce,
            recipe=self.recipe if self.weights == "fp8" else None,
            weights=self.weights if cast_weights or self.weights == "fp8" else "fp32",
            kept_as=self.weights,
        )
        if cast_weights:
            apply_weights_dtype(model, self.weights)
        self.report = report
        if not any(r.kind == "Linear" for r in report.converted) and not report.already_te:
            warnings.warn(
                "precision='fp8' converted no nn.Linear layer, so nothing runs in FP8 and the run is bf16 with"
                f" FP8's overhead ({report.summary()}). Use precision='bf16', or relax the fp8 layer filter"
                " (size_rule='off', keep_last=0, include/exclude).",
                stacklevel=2,
            )
        self._take(model)
        return report

    def adopt(self, model: nn.Module, device: Union[str, torch.device, None] = None) -> int:
        """Take ``model`` as the FP8 model without swapping anything: its layers are Transformer Engine's already
        (converted by :meth:`convert` on a part of it, e.g. in ``configure_model`` before FSDP2 shards it, or built
        so). Checks the hardware, installs the checkpoint hooks; returns how many FP8 GEMM modules it has.

        Example::

            fp8.convert(lightning_module.model, device="cuda")   # in configure_model, before fully_shard
            fp8.adopt(lightning_module)                          # at set-up: state names are the whole module's
        """
        self.check(torch.device(device) if device is not None else torch.device("cuda"))
        self._take(model)
        return len(fp8_gemm_modules(model))

    def _take(self, model: nn.Module) -> None:
        """``model`` is the FP8 model from now on: checkpoint hooks, fresh weight casts, a state waiting applied."""
        install_checkpoint_hooks(model)
        install_primary_hooks(model)
        self._fp8_params = [p for _, _, p in quantized_parameters(model)]
        self._model = model
        self.weight_cache.weights_updated()
        if self._pending is not None:
            pending, self._pending = self._pending, None
            self.load_state_dict(pending)

    def is_converted(self, module: nn.Module) -> bool:
        """Whether ``module`` holds Transformer Engine layers that run FP8 GEMMs (swapped earlier, or built so)."""
        return bool(fp8_gemm_modules(module))

    def prepare_fsdp(self, fsdp_root: nn.Module) -> None:
        """FSDP (1) wrapped the model: each Transformer Engine module that is an FSDP unit of its own gets its process
        group (TE then shards its FP8 weight copies and saved activations between forward and backward)."""
        from transformer_engine.pytorch.distributed import prepare_te_modules_for_fsdp

        prepare_te_modules_for_fsdp(fsdp_root)

    def release(self) -> None:
        """Undo what the run installed on the model: the saturation watch and the weight cache's hooks."""
        self.watch_saturation(False)
        self.weight_cache.detach()

    def layer_stats(self) -> dict[str, dict[str, float]]:
        """Per FP8 layer, the scaling Transformer Engine keeps (delayed scaling): the scale and the latest amax of
        the input (``input_*``), the weight (``weight_*``) and the output gradient (``grad_*``), and
        ``*_headroom``: the fp8 range over the scaled latest amax (below 1: that tensor's largest values were clipped
        to the format's maximum at the last cast). Empty for recipes that keep no scaling state (current, block,
        mxfp8 scale each tensor from itself: nothing saturates by construction). One host read per call."""
        if self._model is None:
            return {}
        # (what to read, as (layer, tensor name, its format's maximum, scale, amax) device scalars: one host copy)
        wanted: list[tuple[str, str, float, Tensor, Tensor]] = []
        for fqn, module in named_modules_unwrapped(self._model).items():
            meta = getattr(module, "fp8_meta", None)
            if not isinstance(meta, dict) or "scaling_fwd" not in meta or not _is_delayed(meta.get("recipe")):
                continue
            wanted += [(fqn, *entry) for entry in _delayed_layer_tensors(meta)]
        if not wanted:
            return {}
        values = torch.stack([torch.stack([scale.float(), amax.float()]) for *_, scale, amax in wanted]).tolist()
        out: dict[str, dict[str, float]] = {}
        for (fqn, name, top, _, _), (scale, amax) in zip(wanted, values):
            stats = out.setdefault(fqn, {})
            stats[f"{name}_scale"], stats[f"{name}_amax"] = scale, amax
            stats[f"{name}_headroom"] = top / (amax * scale) if amax * scale > 0 else float("inf")
        return out

    def configure_weight_cache(self, *, accumulate_grad_batches: int = 1, automatic_optimization: bool = True) -> bool:
        """Attach or detach the :class:`MicrobatchWeightCache` per ``cache_fp8_weights``; returns whether it is on.

        Example::

            fp8.configure_weight_cache(accumulate_grad_batches=trainer.accumulate_grad_batches)
        """
        mode = self.config.cache_fp8_weights
        on = mode == "always" or (mode == "auto" and automatic_optimization and accumulate_grad_batches > 1)
        if on and self._model is not None:
            if self.weight_cache.target is not self._model:
                self.weight_cache.attach(self._model)
        else:
            self.weight_cache.detach()
        return self.weight_cache.attached

    def connect_optimizers(self, optimizers: list[Any]) -> int:
        """FP8 primary weights (``weights="fp8"``): check that the optimizers keep their fp32 masters and start
        those from the exact fp32 weights; returns how many were seeded (0 without FP8 primary weights).

        Raises ``ValueError`` naming an optimizer that steps FP8 weights without masters of its own.
        """
        self._optimizers = list(optimizers)
        if not self._fp8_params:
            return 0
        assert self._model is not None  # _fp8_params: found in the model taken (_take)
        return seed_masters(self._model, self._optimizers)

    def requantize_weights(self) -> int:
        """Write the FP8 primary weights from their optimizers' masters with the current scales (done at the first
        training step after :meth:`load_state_dict`, so a resumed run computes with the uninterrupted run's bytes)."""
        self._requantize = False
        return requantize_from_masters(self._optimizers)

    # ------------------------------------------------------------------ per step
    def _te_autocast(self) -> Any:
        if self._autocast_fn is None:
            te, recipe = import_te(), self.recipe
            if autocast_api(te) == "autocast":
                self._autocast_fn = lambda: te.autocast(enabled=True, recipe=recipe)
            else:
                self._autocast_fn = lambda: te.fp8_autocast(enabled=True, fp8_recipe=recipe)
        return self._autocast_fn()

    def autocast(self, training: bool = True) -> Any:
        """The FP8 region for one step: TE's autocast with the recipe (training, or eval with ``fp8_in_eval``).

        Example::

            with torch.autocast("cuda", torch.bfloat16), fp8.autocast(training=False):
                val_loss = model(x)        # bf16 unless fp8_in_eval=True

        Outside it the TE modules compute in the surrounding autocast dtype (bf16). In training it also turns
        the micro-batch weight cache on, when attached.
        """
        if not (training or self.config.fp8_in_eval):
            return contextlib.nullcontext()
        return _FP8Region(self, training)

    def weights_updated(self) -> None:
        """Call after every optimizer step: cached FP8 weight casts (and FP8 weights' transposes) are stale."""
        self.weight_cache.weights_updated()
        if self._fp8_params:
            refresh_transposes(self._fp8_params)

    def watch_saturation(self, on: bool = True) -> Optional[str]:
        """Start (or stop) the saturation sentinel on the converted model's FP8 modules; returns its mode.

        Example::

            fp8.watch_saturation()                  # 'amax' with delayed scaling, 'hooks' otherwise
            ...backward...
            flag = fp8.sentinel.take()              # > 0: an FP8 operand held inf/NaN: skip this step
        """
        self.sentinel.detach()
        if not on or not self.config.check_saturation or self._model is None:
            return None
        return self.sentinel.attach(fp8_gemm_modules(self._model), delayed=_is_delayed(self.recipe), root=self._model)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The recipe settings and every module's delayed-scaling state: plain tensors, numbers and strings."""
        modules = fp8_scaling_state(self._model) if self._model is not None else {}
        return {
            "format": STATE_FORMAT,
            "recipe": self.config.recipe_settings(),
            "te_version": te_version(),
            "modules": modules,
        }

    def load_state_dict(self, state: Optional[dict[str, Any]]) -> None:
        """Restore :meth:`state_dict`'s output; warns when the recipe changed (state dropped or adapted).

        Before :meth:`convert` the state waits and is applied by it.
        """
        if not state:
            return
        if not isinstance(state, dict) or "recipe" not in state or not isinstance(state.get("modules", {}), dict):
            raise ValueError(
                "The checkpoint's FP8 state is corrupted: expected a dict with 'recipe' and 'modules',"
                f" got {state!r:.200}."
            )
        if self._model is None:
            self._pending = state  # applied by convert()
            return
        self._requantize = bool(self._fp8_params)  # from the masters the optimizer state brings
        restore, message = scaling_state_compat(state["recipe"], self.config.recipe_settings())
        if message:
            warnings.warn(message, stacklevel=2)
        if not restore or not state.get("modules"):
            return
        saved = state["modules"]
        done = load_fp8_scaling_state(self._model, saved, self.recipe)
        missing = sorted(set(saved) - set(done))
        if missing:
            warnings.warn(
                f"MPPlugin: {len(missing)} module(s) in the checkpoint's FP8 state are not Transformer Engine modules"
                f" of this model (e.g. {missing[0]!r}): the fp8 layer filter changed since the checkpoint; their"
                " scales recalibrate.",
                stacklevel=2,
            )
        self.weight_cache.weights_updated()
