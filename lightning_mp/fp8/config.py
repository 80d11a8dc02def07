"""FP8Config: what ``MPPlugin("fp8", fp8=...)`` runs, as a frozen dataclass of YAML-settable fields.

Example::

    >>> from lightning_mp.fp8 import FP8Config
    >>> FP8Config.from_dict({"recipe": "delayed", "amax_history_len": 16, "exclude": ["head"]}).amax_history_len
    16

Configuration only: nothing here imports Transformer Engine. The recipe objects are built in
:mod:`lightning_mp.fp8.runtime`, the layer filter in :mod:`lightning_mp.fp8.filters`.
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass
from typing import Any, Literal, Optional, Union

RecipeName = Literal["delayed", "current", "block", "mxfp8", "tensorwise", "rowwise", "rowwise_with_gw_hp"]
BackendName = Literal["transformer_engine", "torchao"]

#: backend -> its recipes, the first its default (``recipe`` left unset)
BACKEND_RECIPES: dict[str, tuple[str, ...]] = {
    "transformer_engine": ("delayed", "current", "block", "mxfp8"),
    "torchao": ("tensorwise", "rowwise", "rowwise_with_gw_hp"),
}
#: the backends' names in messages
BACKEND_TITLES: dict[str, str] = {"transformer_engine": "Transformer Engine", "torchao": "torchao"}
#: how the backend may be written (YAML, the CLI) -> its name
BACKEND_ALIASES: dict[str, str] = {
    "transformer_engine": "transformer_engine", "transformer-engine": "transformer_engine", "te": "transformer_engine",
    "torchao": "torchao", "ao": "torchao",
}  # fmt: skip

#: recipe name -> the class in ``transformer_engine.common.recipe``
RECIPE_CLASSES: dict[str, str] = {
    "delayed": "DelayedScaling",
    "current": "Float8CurrentScaling",
    "block": "Float8BlockScaling",
    "mxfp8": "MXFP8BlockScaling",
}
#: the format each recipe uses when ``fp8_format`` is left unset (Transformer Engine's own defaults)
DEFAULT_FORMATS: dict[str, str] = {
    "delayed": "HYBRID", "current": "HYBRID", "block": "E4M3", "mxfp8": "E4M3",
    # (torchao's: tensorwise casts output gradients to E5M2)
    "tensorwise": "HYBRID", "rowwise": "E4M3", "rowwise_with_gw_hp": "E4M3",
}  # fmt: skip
FORMATS = ("HYBRID", "E4M3")
#: recipe-specific fields and the recipes they apply to
RECIPE_ONLY_FIELDS: dict[str, tuple[str, ...]] = {
    "margin": ("delayed", "mxfp8"),
    "amax_history_len": ("delayed",),
    "amax_compute_algo": ("delayed",),
}
AMAX_COMPUTE_ALGOS = ("max", "most_recent")
WEIGHTS = ("auto", "fp32", "bf16", "fp8")
SIZE_RULES = ("auto", "off")
CACHE_MODES = ("auto", "always", "never")


@dataclass(frozen=True)
class FP8Config:
    """FP8 training settings: recipe, which layers run in FP8, weight dtype, evaluation and caching.

    Example::

        from lightning_mp import MPPlugin
        from lightning_mp.fp8 import FP8Config

        MPPlugin("fp8", fp8=FP8Config(recipe="current", keep_first=1, exclude=["*.router"]))
        MPPlugin("fp8", fp8={"recipe": "delayed", "amax_history_len": 1024})   # the same from a dict / YAML

    Every field has a plain type, so a Lightning CLI YAML sets it one-to-one::

        plugins:
          - class_path: lightning_mp.MPPlugin
            init_args: {precision: fp8, fp8: {recipe: delayed, amax_history_len: 1024, keep_last: 1}}

    Args:
        backend: the FP8 library: ``"transformer_engine"`` (NVIDIA Transformer Engine; ``"te"``) or ``"torchao"``
            (torchao's float8 training; ``"ao"``). See :mod:`lightning_mp.fp8.backend`.
        recipe: how FP8 scaling factors are chosen; ``None``: the backend's default (``"delayed"``, ``"tensorwise"``:
            chosen on three seeds' convergence). Transformer Engine: ``"delayed"`` (``DelayedScaling``: per-tensor
            scales from an amax history, the fastest on Hopper), ``"current"`` (``Float8CurrentScaling``: per-tensor
            scales from the current tensor), ``"block"`` (``Float8BlockScaling``: 1x128/128x128 blocks, Hopper with
            CUDA 12.9+) or ``"mxfp8"`` (``MXFP8BlockScaling``: 32-element blocks, Blackwell only). torchao:
            ``"tensorwise"`` (one dynamic scale a tensor), ``"rowwise"`` (a scale a row, every GEMM in FP8) or
            ``"rowwise_with_gw_hp"`` (rowwise, the weight-gradient GEMM in bf16: torchao's more accurate variant).
        fp8_format: ``"HYBRID"`` (E4M3 forward, E5M2 gradients) or ``"E4M3"`` everywhere; ``None`` takes the
            recipe's default (HYBRID for delayed/current, E4M3 for block/mxfp8).
        margin: scaling-factor margin in powers of two (delayed, mxfp8); ``None``: 0.
        amax_history_len: length of the amax history window (delayed); ``None``: 1024.
        amax_compute_algo: ``"max"`` over the history or ``"most_recent"`` (delayed); ``None``: ``"max"``.
        include: fully-qualified-name globs (``fnmatch``) of the ``nn.Linear``/``nn.LayerNorm`` modules that may
            run in Transformer Engine; default every module.
        exclude: globs of modules that stay torch modules (checked after ``include``), e.g. ``["head", "*.router"]``.
        keep_first: keep the model's first N ``nn.Linear`` layers (registration order) in bf16.
        keep_last: keep the model's last N ``nn.Linear`` layers in bf16; the default 1 keeps the output head
            of a language model out of FP8, as Megatron-LM and torchtitan do.
        size_rule: ``"auto"`` skips layers too small for FP8 to pay (see
            :func:`lightning_mp.fp8.filters.auto_size_rule`); ``"off"`` converts every eligible shape.
        min_features: with ``size_rule="auto"``, the smallest ``min(in_features, out_features)`` converted;
            ``None`` uses :data:`lightning_mp.fp8.filters.AUTO_MIN_FEATURES` (2048).
        convert_layernorm: also swap ``nn.LayerNorm`` for ``te.LayerNorm`` (a fused kernel with bf16 output);
            ``None``: yes with Transformer Engine (torchao swaps linears only).
        weights: the dtype the model's weights are kept in. ``"auto"`` (the default): with fp32 master weights
            (``MPPlugin``'s ``master_weights`` default) the FP8 layers keep fp32 weights, which the optimizer steps
            directly (the layer quantizes from them: they are their own masters), and every other weight is bf16
            with an fp32 master in the step, so activations are bf16; with another kind (``"none"`` for
            Lightning's layout, ``"kahan"``, ``"stochastic"``, ``"optimizer"``) every weight is bf16; under
            FSDP/FSDP2 fp32 shards (they are the masters) gathered for compute. ``"bf16"``: every weight bf16,
            with master weights per ``master_weights``. ``"fp32"``: fp32 weights under bf16
            autocast (the optimizer steps fp32; activations between layers fp32: slower, the layout before 0.2);
            ``"fp8"`` stores the FP8 layers'
            weights in FP8 (Transformer Engine's ``quantized_model_init``): FSDP2 (``ModelParallelStrategy``)
            gathers them in FP8, half the bytes of a bf16 gather, and the fp32 master weights live in the
            optimizer, which must keep them (Transformer Engine's ``FusedAdam(master_weights=True)``; they start
            from the exact fp32 weights). One GPU or FSDP2 only: DDP gathers nothing, and FSDP (1) cannot shard
            FP8 parameters.
        fp8_in_eval: run validation/test/predict in FP8 too; by default they run in bf16 (autocast).
        cache_fp8_weights: pass ``is_first_microbatch`` to Transformer Engine so a weight is cast to FP8 once
            per optimizer step, not once per micro-batch. ``"auto"``: when ``accumulate_grad_batches > 1``;
            ``"always"``: in every training forward (manual optimization that accumulates); ``"never"``.
        check_saturation: also skip steps where an inf reached an FP8 cast, which saturates it into a finite
            value that no gradient check sees (see :mod:`lightning_mp.fp8.sentinel`). Free with delayed scaling
            (TE's own amaxes are read); other recipes read each FP8 GEMM's input and output gradient once more.
            Needs the plugin's inf/NaN check (``skip_nonfinite=True``, the default).
    """

    backend: BackendName = "transformer_engine"
    recipe: RecipeName = None  # type: ignore[assignment]  # (None: the backend's first recipe, set at init)
    fp8_format: Optional[Literal["HYBRID", "E4M3"]] = None
    margin: Optional[int] = None
    amax_history_len: Optional[int] = None
    amax_compute_algo: Optional[Literal["max", "most_recent"]] = None
    include: tuple[str, ...] = ("*",)
    exclude: tuple[str, ...] = ()
    keep_first: int = 0
    keep_last: int = 1
    size_rule: Literal["auto", "off"] = "auto"
    min_features: Optional[int] = None
    convert_layernorm: Optional[bool] = None
    weights: Literal["auto", "fp32", "bf16", "fp8"] = "auto"
    fp8_in_eval: bool = False
    cache_fp8_weights: Literal["auto", "always", "never"] = "auto"
    check_saturation: bool = True

    def __post_init__(self) -> None:
        def put(name: str, value: Any) -> None:
            object.__setattr__(self, name, value)

        backend = BACKEND_ALIASES.get(str(self.backend).strip().lower()) if isinstance(self.backend, str) else None
        if backend is None:
            raise ValueError(
                f"fp8 backend={self.backend!r} is invalid. Accepted values: 'transformer_engine', 'torchao'."
            )
        put("backend", backend)
        recipes = BACKEND_RECIPES[backend]
        if self.recipe is None:
            put("recipe", recipes[0])
        else:
            other = [b for b, names in BACKEND_RECIPES.items() if b != backend
                     and isinstance(self.recipe, str) and self.recipe.strip().lower() in names]  # fmt: skip
            if other:
                raise ValueError(
                    f"fp8 recipe={self.recipe!r} is a recipe of backend={other[0]!r}, not of backend={backend!r}"
                    f" (its recipes: {', '.join(repr(r) for r in recipes)}). Set backend={other[0]!r}, or pick one"
                    " of those."
                )
            put("recipe", _choice("recipe", self.recipe, recipes, lower=True))
        if self.fp8_format is not None:
            put("fp8_format", _choice("fp8_format", self.fp8_format, FORMATS, upper=True))
        if self.amax_compute_algo is not None:
            put(
                "amax_compute_algo",
                _choice("amax_compute_algo", self.amax_compute_algo, AMAX_COMPUTE_ALGOS, lower=True),
            )
        _check_int("margin", self.margin, minimum=0, optional=True)
        _check_int("amax_history_len", self.amax_history_len, minimum=1, optional=True)
        for name, recipes in RECIPE_ONLY_FIELDS.items():
            if getattr(self, name) is not None and self.recipe not in recipes:
                only = " or ".join(repr(r) for r in recipes)
                raise ValueError(
                    f"fp8 {name}={getattr(self, name)!r} applies to recipe={only} only, not recipe={self.recipe!r}."
                    f" Remove {name}, or use recipe={recipes[0]!r}."
                )
        put("include", _patterns("include", self.include))
        put("exclude", _patterns("exclude", self.exclude))
        if not self.include:
            raise ValueError("fp8 include=[] selects no module: use ['*'] (every module) or a list of name globs.")
        _check_int("keep_first", self.keep_first, minimum=0)
        _check_int("keep_last", self.keep_last, minimum=0)
        put("size_rule", _choice("size_rule", self.size_rule, SIZE_RULES, lower=True))
        _check_int("min_features", self.min_features, minimum=0, optional=True)
        if self.min_features is not None and self.size_rule != "auto":
            raise ValueError(
                f"fp8 min_features={self.min_features} takes effect with size_rule='auto' only, not"
                f" size_rule={self.size_rule!r}. Remove min_features, or set size_rule='auto'."
            )
        for name in ("convert_layernorm", "fp8_in_eval", "check_saturation"):
            if not isinstance(getattr(self, name), bool) and not (name == "convert_layernorm" and self.convert_layernorm
                                                                  is None):
                raise ValueError(f"fp8 {name}={getattr(self, name)!r} is invalid: use true or false.")
        put("weights", _choice("weights", self.weights, WEIGHTS, lower=True))
        if backend == "torchao":
            for name in ("fp8_format", "convert_layernorm"):
                if getattr(self, name):
                    raise ValueError(
                        f"fp8 {name}={getattr(self, name)!r} applies to backend='transformer_engine' only: torchao"
                        " swaps nn.Linear layers alone, and its recipes fix the formats (E4M3 forward and backward)."
                        f" Remove {name}."
                    )
        put("convert_layernorm", backend == "transformer_engine" if self.convert_layernorm is None
            else self.convert_layernorm)  # fmt: skip
        put("cache_fp8_weights", _choice("cache_fp8_weights", self.cache_fp8_weights, CACHE_MODES, lower=True))

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "FP8Config":
        """Build from a plain dict (a YAML mapping); unknown keys raise, naming the accepted ones.

        Example::

            FP8Config.from_dict({"recipe": "current", "keep_first": 1})
        """
        if not isinstance(values, dict):
            raise ValueError(f"fp8 settings must be a dict, got {type(values).__name__}: {values!r}.")
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = [k for k in values if k not in names]
        if unknown:
            key = unknown[0]
            close = difflib.get_close_matches(str(key), names, n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise ValueError(f"Unknown fp8 setting {key!r}.{hint} Accepted settings: {', '.join(names)}.")
        return cls(**values)

    @classmethod
    def from_value(cls, value: Union["FP8Config", dict[str, Any], None]) -> "FP8Config":
        """``None`` -> the defaults, a dict -> :meth:`from_dict`, an ``FP8Config`` -> itself.

        Example::

            FP8Config.from_value(None).recipe   # 'delayed'
        """
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, dict):
            return cls.from_dict(value)
        raise ValueError(
            f"fp8={value!r} is invalid: pass a dict of settings (e.g. {{'recipe': 'current'}}), an FP8Config, or None."
        )

    def to_dict(self) -> dict[str, Any]:
        """Plain types only (lists, not tuples): what a YAML file would hold."""
        out = dataclasses.asdict(self)
        out["include"], out["exclude"] = list(self.include), list(self.exclude)
        return out

    # ------------------------------------------------------------------ derived values
    @property
    def effective_format(self) -> str:
        """The FP8 format the recipe runs with (``fp8_format`` or the recipe's default)."""
        return self.fp8_format or DEFAULT_FORMATS[self.recipe]

    def recipe_settings(self) -> dict[str, Any]:
        """The recipe as plain values (what checkpoints record to detect a recipe change on resume).

        Example::

            FP8Config(recipe="delayed").recipe_settings()
            # {'recipe': 'delayed', 'fp8_format': 'HYBRID', 'margin': 0, 'amax_history_len': 1024,
            #  'amax_compute_algo': 'max'}
        """
        settings: dict[str, Any] = {"recipe": self.recipe, "fp8_format": self.effective_format}
        if self.recipe in RECIPE_ONLY_FIELDS["margin"]:
            settings["margin"] = 0 if self.margin is None else self.margin
        if self.recipe == "delayed":
            settings["amax_history_len"] = 1024 if self.amax_history_len is None else self.amax_history_len
            settings["amax_compute_algo"] = self.amax_compute_algo or "max"
        return settings


def settle_weights(config: FP8Config, *, sharded: bool, master_weights: Optional[str] = None) -> str:
    """``weights="auto"`` settled for a run: ``"mixed"`` with fp32 master weights (the default), ``"bf16"`` with any
    other ``master_weights`` kind, ``"fp32"`` where the model is sharded (FSDP/FSDP2: the fp32 shards are the masters,
    gathered for compute). Any other value stands.

    ``"mixed"``: the FP8 layers keep fp32 weights, which the optimizer steps directly (they are their own master
    weights: the layer quantizes from them each step, so a bf16 copy would only be a third copy of the weight), and
    every other weight is bf16 with an fp32 master in the step, so activations are bf16, as under Lightning's
    Transformer Engine plugin. ``"bf16"``: every weight bf16 (the memory-saving kinds ``"none"``, ``"kahan"``,
    ``"stochastic"``, and ``"optimizer"``, whose optimizer keeps fp32 masters itself, ask for no fp32 weights)."""
    if config.weights != "auto":
        return config.weights
    if sharded:
        return "fp32"
    return "mixed" if master_weights in (None, "fp32") else "bf16"


def _choice(name: str, value: Any, accepted: tuple[str, ...], *, lower: bool = False, upper: bool = False) -> str:
    if isinstance(value, str):
        key = value.strip()
        key = key.lower() if lower else key.upper() if upper else key
        if key in accepted:
            return key
    raise ValueError(f"fp8 {name}={value!r} is invalid. Accepted values: {', '.join(repr(a) for a in accepted)}.")


def _check_int(name: str, value: Any, *, minimum: int, optional: bool = False) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        extra = ", or null for the default" if optional else ""
        raise ValueError(f"fp8 {name}={value!r} is invalid: use an integer >= {minimum}{extra}.")


def _patterns(name: str, value: Any) -> tuple[str, ...]:
    # a single string is accepted for convenience; stored as a tuple so the frozen config stays hashable
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, (list, tuple)) or not all(isinstance(p, str) and p.strip() for p in value):
        raise ValueError(
            f"fp8 {name}={value!r} is invalid: use a list of module-name globs, e.g. ['blocks.*', 'head']."
        )
    return tuple(p.strip() for p in value)
