"""MPFabricPrecision: lightning_mp for Lightning Fabric, on the same optimizer step as the Trainer's ``MPPlugin``.

Fabric hands a precision plugin less than the Trainer does: ``convert_module`` sees the model at ``fabric.setup``
(before Fabric moves it to the device), ``forward_context`` opens around each forward, ``backward`` gets the loss,
``optimizer_step`` and ``unscale_gradients`` (``fabric.clip_gradients``) get the optimizer alone. So the run is
set up in two parts:

- at ``convert_module``: in true-half modes the FP32 guards and the cast to half (Fabric's ``HalfPrecision`` casts
  there too; the guard spec of these modes does not depend on the device);
- at the first contact after it (a forward, ``backward``, a step, :meth:`MPFabricPrecision.setup_optimizers`), on
  the device the parameters are on: the mode's device checks and scaler, the guards of the other modes (which
  depend on the device type), the master weights, and the :class:`~lightning_mp.step.OptimizerSteps` that runs
  every step. An optimizer joins at its first contact (or :meth:`~MPFabricPrecision.setup_optimizers`).

Each ``optimizer.step()`` is one whole step, as under Fabric's ``MixedPrecision`` (its ``GradScaler`` updates right
after each step): the loss scale moves and the buffer snapshot goes after it. Fabric has no end-of-run hook:
:meth:`MPFabricPrecision.teardown` undoes what the plugin changed on the model.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Sequence
from typing import Any, Callable, Optional, cast

import torch
from lightning.fabric.plugins.precision import MixedPrecision, Precision
from lightning.fabric.plugins.precision.utils import _convert_fp_tensor, _DtypeContextManager
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from lightning_utilities import apply_to_collection
from torch import Tensor, nn
from torch.optim import Optimizer
from typing_extensions import override

import lightning_mp.distributed as distributed
from lightning_mp.checkpoint import _load_master_weights, load_plugin_state, normalise, plugin_state
from lightning_mp.guards import guard_for_run
from lightning_mp.host import LoopHost
from lightning_mp.master import _FP32_ORIGINALS, fp32_original, stamp
from lightning_mp.modes import MODES, PrecisionMode, running_mode
from lightning_mp.nonfinite import NonfiniteGuard
from lightning_mp.options import announce
from lightning_mp.scaling import DynamicLossScaler
from lightning_mp.settings import MasterKind, MPSettings
from lightning_mp.step import OptimizerSteps
from lightning_mp.surface import PrecisionRun
from lightning_mp.true_half import cast_weights_

_HALF = (torch.bfloat16, torch.float16)


# (precision and the others are read-only views here of attributes Lightning's bases declare writable). Fabric's
# MixedPrecision is a base for the code that dispatches on it (Fabric's ThroughputMonitor reads _desired_input_dtype
# of its MixedPrecision/HalfPrecision); every method it defines is overridden here, and none reaches it through super()
class MPFabricPrecision(PrecisionRun, MixedPrecision):  # type: ignore[misc, override]
    """lightning_mp's precision for Lightning Fabric: autocast or true-half weights, loss scaling, FP32 guards,
    master weights, and inf/NaN step skipping, with :class:`~lightning_mp.MPPlugin`'s modes and arguments.

    Example::

        plugin = MPFabricPrecision("bf16-true")
        fabric = Fabric(accelerator="cuda", devices=1, plugins=[plugin])
        model, optimizer = fabric.setup(model, optimizer)
        plugin.setup_optimizers(optimizer)          # before fabric.load: the optimizer state stays fp32
        for batch in loader:
            loss = model(batch).mean()
            fabric.backward(loss)
            fabric.clip_gradients(model, optimizer, max_norm=1.0, error_if_nonfinite=False)
            optimizer.step()                        # skipped (nothing changes) if a gradient is inf/NaN
            optimizer.zero_grad()
        fabric.save("ckpt.pt", {"model": model, "optimizer": optimizer, "precision": plugin})
        plugin.teardown()                           # the model is a plain module again
        print(plugin.stats)                         # steps, skipped_steps, loss_scale, ...

    The arguments are :class:`~lightning_mp.MPPlugin`'s (checked by the same
    :class:`~lightning_mp.settings.MPSettings`), except three that have nothing to act on under Fabric:
    ``hold_schedulers_on_skip`` and ``release_grads_after_step`` (the loop steps its schedulers and zeroes its
    gradients itself: read ``plugin.stats.skipped_for(optimizer)`` to hold its scheduler), and
    ``reduce_dtype``/``fsdp_param_dtype``, which are refused (Fabric wraps the model after this plugin sees it; a DDP
    communication hook goes to ``DDPStrategy(ddp_comm_hook=...)``).
    """

    def _start(self, settings: MPSettings) -> None:
        _refuse_wrapper_dtypes(settings)
        super()._start(settings)
        self._modules: list[nn.Module] = []  # what fabric.setup converted, in order
        self._container: Optional[nn.Module] = None  # the module, or a ModuleList of several (names, buffers)
        self._optimizers: list[Optimizer] = []  # in the order they joined (their counters' order)
        self._device = torch.device("cpu")  # where the parameters are (set at the first contact)
        self._guarded: set[int] = set()  # ids of the modules whose FP32 guards are installed
        #: a loaded checkpoint's (mode, master weights), applied at the next step: once fabric.load has loaded the
        #: model whatever the order of its state dict, and the optimizers are known
        self._pending: Optional[tuple[Any, Any]] = None
        self._loads = LoadedValues(self._follows_loads)  # fp32 values of half weights state dicts loaded

    # ------------------------------------------------------------------ set-up
    @override
    def convert_module(self, module: nn.Module) -> nn.Module:
        """``fabric.setup``: in true-half modes guard the FP32 modules and cast the other weights to half (in place);
        the other modes' guards wait for the device (the first forward)."""
        if any(m is module for m in self._modules):
            return module
        self._modules.append(module)
        self._container = self._modules[0] if len(self._modules) == 1 else nn.ModuleList(self._modules)
        mode = self._run.mode
        if mode is not None and mode.true_half:
            self._guard(module, device_type=None)
        self._follow_loads(module)
        if mode is not None and mode.fp8:
            self._run.convert_fp8(module, torch.device(self._run.device))  # (raises where FP8 cannot run)
        if self._steps is not None:  # a model set up after training started (a teacher, a second model)
            self._guard(module, device_type=self._device.type)  # (Fabric moves it there after this hook)
            self._name_parameters()
        return module

    def setup_optimizers(self, *optimizers: Any) -> None:
        """Give the plugin the run's optimizers now, after ``fabric.setup`` (Fabric's optimizers or torch's).

        Optional for training (an optimizer joins at its first step), needed for an exact resume: before
        ``fabric.load``, so that loading the optimizer state keeps it fp32 for half-precision parameters (torch's
        ``Optimizer.load_state_dict`` casts it to the parameters' dtype otherwise)."""
        raw = [_unwrap(optimizer) for optimizer in optimizers]
        self._connected(raw)
        for optimizer in raw:
            self._join(optimizer)

    def _guard(self, module: nn.Module, device_type: Optional[str]) -> None:
        """Install the FP32 guards on ``module`` for this run (once), with their undo recorded."""
        if id(module) in self._guarded:
            return
        self._guarded.add(id(module))
        guarded, unguard = guard_for_run(module, self._fp32_guard_spec(device_type))
        self._patches.add(f"FP32 guards on {len(guarded)} modules of {type(module).__name__}", unguard)
        self._patches.add(f"fp32 weights of the guarded modules of {type(module).__name__}",
                          cast_weights_(module, self.mode, guarded))  # fmt: skip

    def _follow_loads(self, module: nn.Module) -> None:
        """State dicts loaded into the set-up model hand the masters their fp32 values (:class:`LoadedValues`)."""
        self._patches.add(f"fp32 values of state dicts loaded into {type(module).__name__}", self._loads.watch(module))

    def _follows_loads(self) -> bool:
        kind = MasterKind.of(self.master_weights)
        return kind is not None and kind.ours

    def _connected(self, optimizers: Sequence[Optimizer] = ()) -> OptimizerSteps:
        """The run's step, set up at the first contact after ``fabric.setup``, on the parameters' device, with the
        optimizers known by then (``optimizers``: given to :meth:`setup_optimizers`)."""
        if self._steps is not None:
            return self._steps
        container = self._container
        if container is None:
            raise MisconfigurationException(
                "MPFabricPrecision: no model was set up. Call fabric.setup(model, optimizer) (or"
                " fabric.setup_module(model)) before training: the plugin converts and guards the model there."
            )
        for optimizer in optimizers:
            _check_optimizer(optimizer)
        self._optimizers = list(optimizers)
        self._device = device = distributed.root_device(None, container)
        run = self._run
        # (a first contact under torch.inference_mode(), an evaluation before training: the loss scale and what the
        # run keeps are made as ordinary tensors, which training's autograd can use)
        with torch.inference_mode(False):
            run.connect(device)  # auto settles, the device is checked, the scaler moves there, TF32
            for module in self._modules:
                self._guard(module, device.type)
            announce(self)
            distributed.connect(container, run.scaler, None, None, [])  # under DDP every rank takes the worst verdict
            # (each optimizer.step() a whole step; optimizers that join later join this list)
            host = LoopHost(self.stats, type(self).__name__)
            return self._open_steps(host, container, self._optimizers, device=device)

    @property
    def active_mode(self) -> PrecisionMode:
        return self._run.active

    def _name_parameters(self) -> None:
        """Masters and counters name parameters after the set-up models (checkpoints, ``NonFiniteDetector``)."""
        container = self._container
        assert container is not None  # (after convert_module)
        if self.masters is not None:
            self.masters.name_parameters(container)
        self.stats.set_namer(self._weights.namer(container))

    def _join(self, optimizer: Optimizer) -> None:
        """An optimizer seen for the first time joins the run: the master weights are set up again for the
        optimizers known now (its half parameters get masters, made the same on every rank; its state loading keeps
        them fp32), and the buffer snapshot finds the buffers' owners again."""
        steps = self._steps
        assert steps is not None and self._container is not None  # (after _connected)
        if any(opt is optimizer for opt in self._optimizers):
            return
        _check_optimizer(optimizer)
        self._warn_state_cast(optimizer)
        self._optimizers.append(optimizer)
        masters = self._weights.connect(self.active_mode, self._container, self._optimizers, fsdp=False,
                                        device=self._device)  # fmt: skip
        if masters is not steps.masters:
            raise MisconfigurationException(
                f"MPFabricPrecision(precision={self.active_mode.name!r}): {type(optimizer).__name__} joined a run"
                " whose master weights were set up without it, and it keeps fp32 master weights itself (or the"
                " others do not). Give every optimizer to plugin.setup_optimizers(...) right after fabric.setup,"
                " or pass master_weights='optimizer' with optimizers that keep their own masters."
            )
        self._hold_states([optimizer])
        steps.buffers.forget_plan()

    def _warn_state_cast(self, optimizer: Optimizer) -> None:
        """An optimizer that joins with a half-precision state of half weights whose master weights step in fp32 had
        its state loaded before the plugin knew it (``fabric.load_raw(path, optimizer)``): torch cast it. (After
        ``fabric.load`` the plugin's entry has warned already.)"""
        kind = MasterKind.of(self.master_weights)
        if kind is None or not kind.ours or self._states.active or self._pending is not None:
            return
        if any(k != "step" and isinstance(v, Tensor) and v.dtype in _HALF and getattr(p, "dtype", None) in _HALF
               for p, state in optimizer.state.items() for k, v in state.items()):  # fmt: skip
            rank_zero_warn(
                f"{type(self).__name__}: {type(optimizer).__name__} holds a half-precision state of half-precision"
                " weights whose master weights step in fp32: it was loaded (fabric.load_raw, load_state_dict) before"
                " the plugin knew the optimizer, and torch's Optimizer.load_state_dict cast it to the weights' dtype,"
                " so the resume is not exact. Call plugin.setup_optimizers(optimizer) after fabric.setup and before"
                " loading its state."
            )

    # ------------------------------------------------------------------ forward
    def _dtype(self) -> Optional[torch.dtype]:
        mode = self._run.mode
        return None if mode is None else (mode.param_dtype or mode.autocast_dtype)

    @override
    def convert_input(self, data: Any) -> Any:
        """Floating-point inputs in the mode's 16-bit dtype, as Fabric's ``MixedPrecision``/``HalfPrecision``."""
        dtype = self._dtype()
        return data if dtype is None else apply_to_collection(data, Tensor, _convert_fp_tensor, dst_type=dtype)

    @override
    def convert_output(self, data: Any) -> Any:
        """Floating-point outputs in the default dtype (fp32), as Fabric's plugins: the loss is computed in fp32."""
        if self._dtype() is None:
            return data
        return apply_to_collection(data, Tensor, _convert_fp_tensor, dst_type=torch.get_default_dtype())

    @property
    def _desired_input_dtype(self) -> torch.dtype:  # type: ignore[override]  # (Fabric's plugins: an attribute)
        """The dtype the mode computes in, the attribute Fabric's code reads of its ``MixedPrecision`` and
        ``HalfPrecision`` (its ``ThroughputMonitor`` looks the device's peak FLOPs up with it; user code casts
        inputs and weights to it): bf16/fp16 in the autocast and true-half modes, fp32 in ``fp32``/``tf32``, bf16
        in ``fp8`` (its autocast dtype; :meth:`compute_dtype` names the FP8 GEMMs' rate, ``int8``)."""
        mode = running_mode(self)  # (auto: its choice for the device until set-up settles it)
        dtype = None if mode is None else (mode.param_dtype or mode.autocast_dtype)
        return dtype if dtype is not None else torch.float32

    @override
    def tensor_init_context(self) -> Any:
        """``fabric.init_tensor()``: in true-half modes tensors are made in the half dtype, as by Fabric's
        ``HalfPrecision`` (caches, masks, inputs: what computes with the half weights), master weights or not;
        elsewhere fp32."""
        mode = self._run.mode
        if mode is not None and mode.true_half:
            assert mode.param_dtype is not None  # (true-half: a half param_dtype)
            return _DtypeContextManager(mode.param_dtype)
        return contextlib.nullcontext()

    @override
    def module_init_context(self) -> Any:
        """``fabric.init_module()``: in a true-half mode without master weights the weights are made half directly,
        as Fabric's ``HalfPrecision`` makes them (half the memory at creation; ``fabric.setup`` then keeps the
        FP32-guarded modules fp32, from those values). With master weights (the default of true-half modes) and in
        the other modes they are made fp32: the masters start from the exact fp32 values."""
        if self.master_weights == "none":
            return self.tensor_init_context()
        return contextlib.nullcontext()

    def _foreign_scaler(self) -> Optional[Any]:
        """The loss scaler in use where it is not lightning_mp's: a stand-in with ``GradScaler``'s methods (a test
        double, a class of the user's) given or set as ``plugin.scaler`` (torch's ``GradScaler`` is adopted: never
        this). The plugin cannot judge steps through it, so it scales, unscales, steps and updates as Fabric's
        ``MixedPrecision`` has its scaler do (``None``: the plugin's own step runs)."""
        scaler = self._run.scaler
        return None if scaler is None or isinstance(scaler, (DynamicLossScaler, NonfiniteGuard)) else scaler

    @override
    def forward_context(self) -> Any:
        """Autocast (mixed modes) or the half default dtype (true-half) around a forward. A training forward after
        the last step snapshots the buffers a skipped step puts back."""
        training = torch.is_grad_enabled() and any(m.training for m in self._modules)
        if self._modules:
            steps = self._connected()  # (an evaluation alone runs with the guards of the device too)
            if training:
                steps.begin_batch(self._container, self._optimizers)
        mode = self._run.mode
        if mode is None:
            return contextlib.nullcontext()
        if mode.param_dtype is not None:
            return _DtypeContextManager(mode.param_dtype)
        if mode.autocast_dtype is None:
            return contextlib.nullcontext()
        # no weight-cast cache: fabric.autocast() may hold a whole step, the optimizer's too
        context = torch.autocast(self.device, dtype=mode.autocast_dtype, cache_enabled=False)
        fp8 = self._run.fp8
        if fp8 is not None and mode.fp8:
            stack = contextlib.ExitStack()
            stack.enter_context(context)
            stack.enter_context(fp8.autocast(training=training))
            return stack
        return context

    # ------------------------------------------------------------------ backward
    @override
    def pre_backward(self, tensor: Tensor, module: Optional[nn.Module]) -> Any:
        self._connected().before_backward(cast(nn.Module, self._container), tensor)  # the spike guard's loss

    @override
    def backward(self, tensor: Tensor, model: Optional[nn.Module], *args: Any, **kwargs: Any) -> None:
        scaler = self._run.scaler
        if scaler is not None and getattr(scaler, "scaling", True):  # (a stand-in scaler of the user's scales too)
            tensor = scaler.scale(tensor)
        tensor.backward(*args, **kwargs)

    @override
    def post_backward(self, tensor: Tensor, module: Optional[nn.Module]) -> Any:
        self._connected().after_backward(cast(nn.Module, self._container))

    # ------------------------------------------------------------------ the step and clipping
    def _before_step(self, optimizer: Optimizer) -> OptimizerSteps:
        steps = self._connected()
        self._join(optimizer)
        if self._loads.pending:
            self._loads.take(self.masters)
        if self._pending is not None:
            self._load_pending()
        return steps

    @override
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        """``optimizer.step()``: one whole step of :class:`~lightning_mp.step.OptimizerSteps` (a closure given is
        evaluated first, or by the optimizer where it evaluates closures itself, as LBFGS)."""
        foreign = self._foreign_scaler()
        if foreign is not None:  # a stand-in scaler set by the user: Fabric's MixedPrecision step (it skips itself)
            out = foreign.step(optimizer, **kwargs)
            foreign.update()
            return out
        steps = self._before_step(optimizer)
        closure: Optional[Callable[[], Any]] = kwargs.pop("closure", None)
        result: list[Any] = []
        if closure is None:
            run_closure: Callable[[], Any] = _no_closure
        else:
            def run_closure() -> Any:
                result.append(closure())
                return result[-1]
        out = steps.run(optimizer, run_closure, lambda: steps.loop_ran(optimizer), **kwargs)
        if self._run.fp8 is not None:
            self._run.fp8.weights_updated()  # FP8 weight casts cached across micro-batches expire
        # (torch's step returns the closure's loss: so does this one where the closure ran before the step)
        return result[0] if out is None and result else out

    @override
    def unscale_gradients(self, optimizer: Optimizer) -> None:
        """Before ``fabric.clip_gradients`` clips: the true gradients (unscaled; fp32 in true-half modes) in
        :meth:`main_params`, and the step's inf/NaN verdict taken, since clipping by value makes an inf finite."""
        foreign = self._foreign_scaler()
        if foreign is not None:  # a stand-in scaler set by the user: it unscales, as under Fabric's MixedPrecision
            foreign.unscale_(optimizer)
            return
        self._before_step(optimizer).check_before_clamp(optimizer)

    @override
    def main_params(self, optimizer: Optimizer) -> Any:
        """What ``fabric.clip_gradients`` clips: the optimizer's own parameters, whose gradients the loop reads and
        writes afterwards (true-half: the half gradients, holding the true ones; the step takes them as its fp32
        gradients). Fabric calls nothing after clipping, so clipping fp32 stand-ins would leave the loop reading
        gradients that are not the ones stepped."""
        return Precision.main_params(self, optimizer)

    # ------------------------------------------------------------------ checkpoints
    @override
    def state_dict(self) -> dict[str, Any]:
        """The loss scale, the step counters, the master weights (``fabric.save(path, {..., "precision": plugin})``)."""
        if self._loads.pending:
            self._loads.take(self.masters)
        if self._pending is not None and self._container is not None:
            self._connected()
            self._load_pending()
        state = plugin_state(self._run.name, self._run.scaler, self.masters, self._run.fp8, self.stats, self._spike,
                             self._states)
        if self._pending is not None and self._pending[1] is not None:  # loaded, not applied yet (no model yet)
            state["master_weights"] = self._pending[1]
        else:
            state["master_weights"] = self._with_originals(state.get("master_weights"))
        return state

    def _with_originals(self, saved: Optional[dict[str, Any]]) -> Optional[dict[str, Any]]:
        """``saved`` (the master weights' entry) with the exact fp32 values of the parameters that have no master yet
        (their optimizer has not stepped: a checkpoint right after ``fabric.setup``, a loop that gave its first
        steps up, a second optimizer not stepped yet), so that the resume starts from them as the run would."""
        originals = self._originals()  # (only parameters without a master keep their fp32 original)
        if originals is None:
            return saved
        if saved is None or self.masters is None or not self.masters.named_params():
            return originals
        if saved.get("kind") == "fp32" and isinstance(saved.get("masters"), dict):
            return {**saved, "masters": {**originals["masters"], **saved["masters"]}}
        return saved  # (Kahan and stochastic entries keep no fp32 values to add to)

    def _originals(self) -> Optional[dict[str, Any]]:
        """Before the first step (no master weights made yet): the exact fp32 values the cast to half replaced, as
        fp32 masters, so that a checkpoint saved right after ``fabric.setup`` resumes exactly (``None``: none)."""
        kind = MasterKind.of(self.master_weights)
        if kind is None or not kind.ours or self._container is None:
            return None
        originals = {}
        for name, param in self._container.named_parameters():
            value = fp32_original(param)
            if value is not None:
                originals[name] = value.detach().to(param.device)
        if not originals:
            return None
        dtype = self.active_mode.param_dtype
        return {"kind": "fp32", "dtype": "float16" if dtype is torch.float16 else "bfloat16", "masters": originals}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """The loss scale, counters and loss-spike window now; the master weights at the next step, once the model
        is loaded (whatever the order of the state fabric.load restores) and the optimizers are known. An empty entry
        (Fabric's own plugins of the modes without a loss scale save one) restores nothing, as those plugins do."""
        if isinstance(state_dict, dict) and not state_dict:
            return
        state = normalise(state_dict, type(self).__name__)
        now = {key: value for key, value in state.items() if key != "master_weights"}
        load_plugin_state(now, current_mode=self._run.name, scaler=self._run.scaler, masters=None, master_weights=None,
                          fp8=self._run.fp8, stats=self.stats, module=None, spike=self._spike,
                          optimizer_states=self._states, host=type(self).__name__)  # fmt: skip
        self._pending = (state["mode"], state.get("master_weights"))
        mode = self._run.mode
        if state.get("master_weights") is not None and mode is not None and mode.true_half and not self._optimizers:
            rank_zero_warn(
                "MPFabricPrecision: the checkpoint holds master weights, but no optimizer was given to"
                " plugin.setup_optimizers(...) before fabric.load: torch's Optimizer.load_state_dict casts the"
                " optimizer state of half-precision parameters to their dtype, so the resume is not exact. Call"
                " plugin.setup_optimizers(optimizer) after fabric.setup and before fabric.load."
            )

    def _load_pending(self) -> None:
        pending, self._pending = self._pending, None
        assert pending is not None and self._container is not None  # (callers check both)
        saved_mode, saved = pending
        known = MODES.get(saved_mode) if isinstance(saved_mode, str) else None
        masters = self._steps.masters if self._steps is not None else None
        _load_master_weights(saved, masters, self.master_weights, self._run.name, self._container,
                             known.param_dtype if known is not None else None, type(self).__name__)  # fmt: skip

    # ------------------------------------------------------------------ teardown
    @override
    def teardown(self) -> None:
        """End the run: the last step's state goes, every change to the models and optimizers is undone (FP32
        guards, the fp32 weights of guarded modules in true-half modes become half as Fabric's ``HalfPrecision``
        leaves them, the optimizers' fp32 state loading, TF32 flags). Fabric calls no teardown of its own: call this
        (or ``fabric.strategy.teardown()``) when training ends. The counters, the loss scale and the master weights
        stay with the plugin; ``fabric.setup`` starts another run."""
        try:
            if self._steps is not None:
                self._steps.close()
        finally:
            self._steps = None
            self._modules, self._container, self._optimizers = [], None, []
            self._loads.clear()
            self._guarded.clear()
            self._patches.undo_all()


class LoadedValues:
    """A state dict loaded into a set-up model (``fabric.load_raw(path, model)``, ``model.load_state_dict``) with fp32
    values of half weights: the master weights take those values exactly, as they would from the same weights set up
    fresh (the half weights hold them rounded). Where no master is made yet, the one made at the first step starts
    from them. ``follows``: whether the run's master weights are lightning_mp's (asked at each load)."""

    def __init__(self, follows: Callable[[], bool]) -> None:
        self._follows = follows
        self._loading: list[tuple[Tensor, Tensor]] = []  # (parameter, value) of the load under way
        #: by parameter id: the parameter, its loaded fp32 value, its stamp then
        self.pending: dict[int, tuple[Tensor, Tensor, tuple[int, int]]] = {}

    def watch(self, module: nn.Module) -> Callable[[], Any]:
        """Follow the loads into ``module``; returns what stops it."""
        pre = module.register_load_state_dict_pre_hook(_LoadHook(self, after=False))
        post = module.register_load_state_dict_post_hook(_LoadHook(self, after=True))
        return lambda: (pre.remove(), post.remove())

    def loading(self, module: nn.Module, state_dict: Any, prefix: str) -> None:
        if not self._follows():
            return
        for name, param in module.named_parameters():
            value = state_dict.get(prefix + name)
            if (isinstance(value, Tensor) and value.is_floating_point() and param.dtype in _HALF
                    and value.dtype.itemsize > param.dtype.itemsize and value.shape == param.shape):
                self._loading.append((param, value))

    def loaded(self) -> None:
        """After the load: the fp32 values of the weights it wrote wait for the next step (or save), where they are
        taken if the weights still hold them (a weight written since, e.g. evaluation weights swapped back in with
        the saved half weights, keeps its master as it was)."""
        taken, self._loading = self._loading, []
        with torch.no_grad():
            for param, value in taken:
                value = value.detach().to(param.device, torch.float32)
                if bool(value.to(param.dtype).eq(param).all()):  # (else not written by this load)
                    self.pending[id(param)] = (param, value, stamp(param))

    def take(self, masters: Any) -> None:
        """``masters`` take the fp32 values loads wrote (:meth:`loaded`); a weight without a master yet keeps its
        value for the master made at its first step."""
        pending, self.pending = self.pending, {}
        names = {} if masters is None else {id(p): n for n, p in masters.named_params().items()}
        values: dict[str, Tensor] = {}  # by the masters' names: their entries take them in one call
        for param, value, written in pending.values():
            if stamp(param) != written:
                continue  # (written since: the masters follow the weight as they do any write)
            if id(param) in names:
                values[names[id(param)]] = value
            else:
                _FP32_ORIGINALS[param] = (value, written)  # (the master made at the first step)
        if masters is not None and values:
            masters.load_fp32_values(values)

    def clear(self) -> None:
        self._loading, self.pending = [], {}


class _LoadHook:
    """A load-state-dict hook on a set-up model (:meth:`LoadedValues.watch`), before or after the load. A copy of the
    model (pickled, deep-copied mid-run) is not the run's: its copy of the hook does nothing."""

    def __init__(self, loads: LoadedValues, after: bool) -> None:
        self._loads, self._after = weakref.ref(loads), after

    def __call__(self, module: nn.Module, *args: Any) -> None:
        loads = self._loads()
        if loads is not None and self._after:
            loads.loaded()
        elif loads is not None:
            loads.loading(module, args[0], args[1])  # (the state dict, the prefix)

    def __reduce__(self) -> tuple[Callable[[], Callable[..., None]], tuple[()]]:
        return _inert_load_hook, ()


def _inert_load_hook() -> Callable[..., None]:
    return _no_load_hook


def _no_load_hook(*args: Any) -> None:
    """The load hook of a copy of a set-up model: nothing to follow."""


def _no_closure() -> None:
    """``optimizer.step()`` without a closure: the loop ran forward and backward itself."""


def _check_optimizer(optimizer: Any) -> None:
    if not isinstance(getattr(optimizer, "param_groups", None), list):
        raise MisconfigurationException(
            f"MPFabricPrecision steps torch optimizers, got {type(optimizer).__name__}: it runs on single-device"
            " and DDP strategies. DeepSpeed runs its own precision: use Fabric(precision=...) with it."
        )


def _unwrap(optimizer: Any) -> Optimizer:
    """The torch optimizer inside Fabric's ``_FabricOptimizer``."""
    return getattr(optimizer, "optimizer", optimizer) if hasattr(optimizer, "_strategy") else optimizer


def _refuse_wrapper_dtypes(settings: MPSettings) -> None:
    given = {name: value for name, value in settings.distributed.changed().items() if value not in (None, "fp32")}
    if given:
        names = ", ".join(f"{name}={value!r}" for name, value in given.items())
        raise ValueError(
            f"MPFabricPrecision({names}): Fabric wraps the model in DDP or FSDP after the precision plugin sees it,"
            " so these cannot be applied. Leave them unset; compress DDP's gradients with"
            " DDPStrategy(ddp_comm_hook=...)."
        )
