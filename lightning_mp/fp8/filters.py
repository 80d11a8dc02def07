"""Which ``nn.Linear`` / ``nn.LayerNorm`` modules become Transformer Engine modules: pure ``(module, fqn)`` rules.

Example::

    >>> from torch import nn
    >>> from lightning_mp.fp8.filters import auto_size_rule, te_shape_rule
    >>> te_shape_rule(nn.Linear(4096, 4096), "blocks.0.fc1"), auto_size_rule(nn.Linear(1024, 1024), "proj")
    (True, False)

Each rule takes ``(module, fully_qualified_name)`` and returns ``True`` when the module may run in FP8, the
signature of torchao's ``module_filter_fn``. :func:`build_module_filter` composes the rules an
:class:`~lightning_mp.fp8.config.FP8Config` asks for, for one model, and can say why a module was left out.

Names are matched with ``fnmatch`` (case-sensitive) against the fully qualified name and each dotted suffix
of it, so ``"head"`` matches ``model.head`` and ``"blocks.*"`` matches ``model.blocks.3.fc1`` (the same rule as
the FP32 guards).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Sequence
from typing import Callable, Optional

from torch import nn

from lightning_mp.fp8.config import FP8Config
from lightning_mp.guards import _dotted_suffixes, fp32_guard_of

ModuleFilterFn = Callable[[nn.Module, str], bool]

#: Transformer Engine's FP8 GEMMs need both matrix dimensions divisible by 16
TE_ALIGNMENT = 16

#: smallest ``min(in_features, out_features)`` the "auto" size rule converts. FP8 carries a fixed cost per
#: layer step (quantisation kernels, Python; about 1-1.7 ms measured), so it pays only on large GEMMs. One
#: ``te.Linear`` on 8192 tokens, forward + backward, against torch bf16 on an H200 (shared/GPU.md,
#: 2026-11-26): 1024x1024 ran at 0.22x, 4096x4096 at 0.68-1.1x, 8192x8192 at 1.37-1.50x, 4096->16384 at
#: 1.66x; inside whole GPT models, where the GPU queue hides much of the fixed cost, hidden 2048 gained
#: 1.46x, 4096 1.66x and 8192 1.74x with every linear in FP8. A layer with a 1024-wide side stays bf16; a
#: layer whose sides are both 2048 or more runs FP8. torchao's H100-measured rule is close (tensorwise
#: skips out <= 4096 with in <= 1024).
AUTO_MIN_FEATURES = 2048


def _patterns_match(fqn: str, patterns: Iterable[str]) -> Optional[str]:
    """The first pattern matching ``fqn`` or one of its dotted suffixes, or ``None``."""
    names = _dotted_suffixes(fqn) or [""]
    for pattern in patterns:
        if any(fnmatch.fnmatchcase(name, pattern) for name in names):
            return pattern
    return None


# --------------------------------------------------------------------------------------------- single rules
def te_shape_rule(module: nn.Module, fqn: str) -> bool:
    """``True`` unless ``module`` is an ``nn.Linear`` whose in/out features are not both divisible by 16.

    Example::

        te_shape_rule(nn.Linear(24, 40), "adapter")   # False: TE's FP8 GEMM cannot run it
    """
    return te_shape_problem(module) is None


def te_shape_problem(module: nn.Module) -> Optional[str]:
    """Why Transformer Engine cannot run this linear's shape in FP8, or ``None``."""
    if not isinstance(module, nn.Linear):
        return None
    i, o = module.in_features, module.out_features
    if i % TE_ALIGNMENT or o % TE_ALIGNMENT:
        return f"in_features={i}, out_features={o}: FP8 GEMMs need both divisible by {TE_ALIGNMENT}"
    return None


def auto_size_rule(module: nn.Module, fqn: str, *, min_features: int = AUTO_MIN_FEATURES) -> bool:
    """``True`` unless ``module`` is an ``nn.Linear`` too small for FP8 to be faster than bf16.

    A linear qualifies when ``min(in_features, out_features) >= min_features`` (default
    :data:`AUTO_MIN_FEATURES`, measured on an H200; see there). Non-linear modules pass.

    Example::

        auto_size_rule(nn.Linear(4096, 16384), "fc1")      # True
        auto_size_rule(nn.Linear(1024, 4096), "fc1")       # False: a 1024-wide side
    """
    return size_problem(module, min_features=min_features) is None


def size_problem(module: nn.Module, *, min_features: int = AUTO_MIN_FEATURES) -> Optional[str]:
    """Why the "auto" size rule keeps this linear in bf16, or ``None``."""
    if not isinstance(module, nn.Linear):
        return None
    smaller = min(module.in_features, module.out_features)
    if smaller < min_features:
        return (
            f"too small for FP8 to pay: min(in_features, out_features)={smaller} < {min_features}"
            " (size_rule='auto'; set size_rule='off' to convert it anyway)"
        )
    return None


def name_rule(include: Sequence[str] = ("*",), exclude: Sequence[str] = ()) -> ModuleFilterFn:
    """A rule admitting the modules whose name matches ``include`` and no ``exclude`` glob.

    Example::

        rule = name_rule(exclude=["head", "*.router"])
        rule(nn.Linear(16, 16), "model.head")            # False
    """
    include, exclude = tuple(include), tuple(exclude)

    def rule(module: nn.Module, fqn: str) -> bool:
        return name_problem(fqn, include, exclude) is None

    return rule


def name_problem(fqn: str, include: Sequence[str], exclude: Sequence[str]) -> Optional[str]:
    """Why ``include``/``exclude`` leave this name out, or ``None``."""
    if _patterns_match(fqn, include) is None:
        return f"not matched by include={list(include)}"
    hit = _patterns_match(fqn, exclude)
    if hit is not None:
        return f"matched exclude pattern {hit!r}"
    return None


def linear_names(model: nn.Module) -> list[str]:
    """Fully qualified names of the model's ``nn.Linear`` layers (subclasses too), in registration order.

    Registration order is the order of ``model.named_modules()``; for the usual embed -> blocks -> head layout
    it is the order in which the layers run.
    """
    return [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]


def first_last_rule(model: nn.Module, keep_first: int = 0, keep_last: int = 0) -> ModuleFilterFn:
    """A rule keeping the model's first ``keep_first`` and last ``keep_last`` linear layers out of FP8.

    Computed once over the whole model (a rule applied to a sub-module alone would see the wrong ends).

    Example::

        rule = first_last_rule(model, keep_last=1)
        rule(model.head, "head")                         # False: the output head stays bf16
    """
    ends = first_last_names(model, keep_first, keep_last)

    def rule(module: nn.Module, fqn: str) -> bool:
        return fqn not in ends

    return rule


def first_last_names(model: nn.Module, keep_first: int, keep_last: int) -> dict[str, str]:
    """``{fqn: "first"|"last"}`` of the linear layers ``keep_first``/``keep_last`` protect."""
    names = linear_names(model)
    ends: dict[str, str] = {}
    for name in names[len(names) - keep_last :] if keep_last else []:
        ends[name] = "last"
    for name in names[:keep_first]:
        ends[name] = "first"
    return ends


# --------------------------------------------------------------------------------------------- composition
class ModuleFilter:
    """The layer filter an :class:`FP8Config` describes, bound to one model: ``(module, fqn) -> bool``.

    Example::

        from lightning_mp.fp8 import FP8Config
        from lightning_mp.fp8.filters import ModuleFilter

        keep = ModuleFilter(model, FP8Config(exclude=["head"], size_rule="off"))
        keep(model.blocks[0].fc1, "blocks.0.fc1")        # True
        keep.reason(model.head, "head")                  # "matched exclude pattern 'head'"

    Rules, in the order :meth:`reason` reports them: the module is a plain ``nn.Linear`` (or ``nn.LayerNorm``
    with ``convert_layernorm``) with the parameters TE needs; its name passes ``include``/``exclude``; it is
    not among the first/last ``keep_first``/``keep_last`` linear layers; its shape suits TE's FP8 GEMMs; the
    size rule; its weight is not shared (tied) with another module; it carries no hooks that a swap would
    drop (an FP32 guard keeps its module in fp32); and ``extra`` (a user ``module_filter_fn``) returns True.
    """

    def __init__(self, model: nn.Module, config: Optional[FP8Config] = None, extra: Optional[ModuleFilterFn] = None):
        self.config = config if config is not None else FP8Config()
        self.extra = extra
        self._ends = first_last_names(model, self.config.keep_first, self.config.keep_last)
        owners: dict[int, set[int]] = {}
        for m in model.modules():
            for p in m.parameters(recurse=False):
                owners.setdefault(id(p), set()).add(id(m))
        self._owners = owners

    def __call__(self, module: nn.Module, fqn: str) -> bool:
        return self.reason(module, fqn) is None

    def reason(self, module: nn.Module, fqn: str) -> Optional[str]:
        """Why ``module`` stays a torch module, or ``None`` when it becomes a Transformer Engine module."""
        cfg = self.config
        problem = _kind_problem(module, cfg)
        if problem:
            return problem
        problem = name_problem(fqn, cfg.include, cfg.exclude)
        if problem:
            return problem
        if fqn in self._ends:
            which = self._ends[fqn]
            n = cfg.keep_first if which == "first" else cfg.keep_last
            return f"one of the {which} {n} linear layer(s), kept in bf16 (keep_{which}={n})"
        problem = te_shape_problem(module)
        if problem:
            return problem
        if cfg.size_rule == "auto":
            problem = size_problem(
                module, min_features=AUTO_MIN_FEATURES if cfg.min_features is None else cfg.min_features
            )
            if problem:
                return problem
        for pname, p in module.named_parameters(recurse=False):
            if len(self._owners.get(id(p), ())) > 1:
                return f"its {pname} is shared with another module (tied weights); a swap would untie it"
        problem = _hook_problem(module)
        if problem:
            return problem
        if self.extra is not None and not self.extra(module, fqn):
            return "module_filter_fn returned False"
        return None


def build_module_filter(
    model: nn.Module, config: Optional[FP8Config] = None, extra: Optional[ModuleFilterFn] = None
) -> ModuleFilter:
    """The :class:`ModuleFilter` for ``model`` under ``config``, optionally ANDed with a user rule.

    Example::

        keep = build_module_filter(model, FP8Config(keep_first=1), extra=lambda m, fqn: "vision" not in fqn)
    """
    return ModuleFilter(model, config, extra)


def _kind_problem(module: nn.Module, cfg: FP8Config) -> Optional[str]:
    kind = type(module)
    if kind is nn.Linear:
        return None
    if kind is nn.LayerNorm:
        assert isinstance(module, nn.LayerNorm)
        if not cfg.convert_layernorm:
            return "convert_layernorm=False"
        if module.weight is None or module.bias is None:
            return "no affine weight and bias (te.LayerNorm always has both)"
        if len(module.normalized_shape) != 1:
            return f"normalized_shape={tuple(module.normalized_shape)} has more than one dimension"
        return None
    if isinstance(module, nn.Linear):
        return f"{kind.__name__} subclasses nn.Linear (it may use its weight directly); only plain nn.Linear is swapped"
    if isinstance(module, nn.LayerNorm):
        return f"{kind.__name__} subclasses nn.LayerNorm; only plain nn.LayerNorm is swapped"
    return f"{kind.__name__} is neither nn.Linear nor nn.LayerNorm"


def _hook_problem(module: nn.Module) -> Optional[str]:
    if fp32_guard_of(module) is not None:
        return "an FP32 guard keeps it in fp32"
    kinds = [
        label
        for label, hooks in (
            ("forward pre-hooks", module._forward_pre_hooks),
            ("forward hooks", module._forward_hooks),
            ("backward hooks", module._backward_hooks),
            ("backward pre-hooks", getattr(module, "_backward_pre_hooks", {})),
        )
        if hooks
    ]
    if kinds:
        return f"has {' and '.join(kinds)}, which a swap would drop"
    return None
