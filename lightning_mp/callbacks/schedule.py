"""PrecisionSchedule: change MPPlugin's precision during training, by step or epoch and on instability.

When it switches (always between two optimizer steps, never inside one):

- ``on_train_start``: the schedule's entry for the step (or epoch) training starts at, on a fresh run;
- ``on_train_batch_end`` of a batch that made an optimizer step (``trainer.global_step`` moved on):
  first the fallback (when the current mode skipped ``max_skips`` steps within ``window`` steps), then the
  schedule's entry for the next step; a gradient-accumulation micro-batch never switches;
- ``on_train_epoch_start`` with ``interval="epoch"``.

On resume Lightning restores callback state before the precision plugin's, so ``load_state_dict`` puts the
plugin back into the saved mode first; ``MPPlugin`` then loads its own state into that mode.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Literal, Optional

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_mp.modes import AUTO, parse_precision, resolve_mode
from lightning_mp.stats import StepStats

INTERVALS = ("step", "epoch")


class PrecisionSchedule(Callback):
    """Switch ``MPPlugin``'s precision by step or epoch, and fall back to a safer mode on instability.

    Example::

        from lightning.pytorch import Trainer
        from lightning_mp import MPPlugin, PrecisionSchedule

        trainer = Trainer(
            plugins=[MPPlugin("fp32")],
            callbacks=[PrecisionSchedule({0: "fp32", 500: "bf16"})],   # fp32 warm-up, then bf16
        )
        trainer = Trainer(
            plugins=[MPPlugin("fp16")],
            callbacks=[PrecisionSchedule(fallback={"fp16": "bf16"}, max_skips=10, window=100)],
        )

    Every switch is logged and kept in ``history``; the current mode, the history and the skip window are
    saved in checkpoints (plain values) and restored on resume. A mode abandoned by a fallback stays
    abandoned: a later schedule entry naming it runs its fallback instead.

    Args:
        schedule: ``{step or epoch: mode}``: from that optimizer step (or epoch) on, train in that mode. Keys
            are integers >= 0; modes are MPPlugin's names or Lightning aliases (``"fp32"``, ``"bf16"``,
            ``"fp16"``, ``"tf32"``, ``"auto"``, ``"bf16-mixed"``, ...).
        interval: ``"step"`` (keys are ``trainer.global_step`` values) or ``"epoch"``.
        fallback: ``{unstable mode: safer mode}``, e.g. ``{"fp16": "bf16", "fp8": "bf16"}``: leave the first
            mode after ``max_skips`` skipped optimizer steps within ``window`` steps. A key may name a mode
            this release cannot run yet (``fp8``): the fallback is then ready for when it can.
        max_skips: skipped steps that count as unstable.
        window: the number of most recent optimizer steps in which ``max_skips`` skips are counted.
        check_every_n_steps: with a fused optimizer on a GPU, MPPlugin knows whether a step was skipped only
            on the device; the schedule then reads the skip counter (one host sync) every this many steps.
    """

    def __init__(
        self,
        schedule: Optional[dict[int, str]] = None,
        interval: Literal["step", "epoch"] = "step",
        fallback: Optional[dict[str, str]] = None,
        max_skips: int = 10,
        window: int = 100,
        check_every_n_steps: int = 10,
    ) -> None:
        super().__init__()
        if interval not in INTERVALS:
            raise ValueError(f"interval={interval!r} is invalid: use 'step' or 'epoch'.")
        if schedule is not None and not isinstance(schedule, dict):
            raise ValueError(
                f"schedule={schedule!r} is invalid: use a mapping {{{interval}: mode}},"
                " e.g. {0: 'fp32', 500: 'bf16'}."
            )
        if fallback is not None and not isinstance(fallback, dict):
            raise ValueError(
                f"fallback={fallback!r} is invalid: use a mapping {{mode: mode}}, e.g. {{'fp16': 'bf16'}}."
            )
        for name, value in (("max_skips", max_skips), ("window", window), ("check_every_n_steps", check_every_n_steps)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} is invalid: use an integer >= 1.")
        if max_skips > window:
            raise ValueError(
                f"max_skips={max_skips} is larger than window={window}: {max_skips} skips can never happen within"
                f" {window} steps; use max_skips <= window."
            )
        self.schedule: dict[int, str] = {}
        for key, mode in (schedule or {}).items():
            step = _key(key, interval)
            self.schedule[step] = _runnable(mode, f"schedule[{key!r}]")
        self.fallback: dict[str, str] = {}
        for source, target in (fallback or {}).items():
            src = _known(source, f"fallback key {source!r}")
            dst = _runnable(target, f"fallback[{source!r}]")
            if src == dst:
                raise ValueError(f"fallback[{source!r}]={target!r} falls back to the same mode; name a different one.")
            self.fallback[src] = dst
        if not self.schedule and not self.fallback:
            raise ValueError(
                "PrecisionSchedule needs a schedule (e.g. {0: 'fp32', 500: 'bf16'}) or a fallback"
                " (e.g. {'fp16': 'bf16'}), or both."
            )
        self.interval = interval
        self.max_skips = max_skips
        self.window = window
        self.check_every_n_steps = check_every_n_steps

        self._plugin: Optional[Any] = None  # the MPPlugin in use
        self._start_run()

    def _start_run(self) -> None:
        """The state of one run (what ``state_dict`` saves): none of it carries over to a run with another plugin."""
        #: the mode training runs in now (a canonical name), ``None`` before training starts
        self.mode: Optional[str] = None
        #: every switch: ``{"step", "epoch", "from", "to", "reason"}``
        self.history: list[dict[str, Any]] = []
        self.abandoned: set[str] = set()
        self._applied: int = -1  # the largest schedule key applied so far
        self._skips: deque[int] = deque()  # steps (with repeats) at which the current mode skipped
        self._counted_skips: Optional[int] = None  # MPPlugin's skipped steps at the last look (None: not known)
        self._last_step: Optional[int] = None

    # ------------------------------------------------------------------ set-up
    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        plugin: Any = trainer.precision_plugin  # MPPlugin, known by what it has (_is_mpplugin)
        if not _is_mpplugin(plugin):
            raise MisconfigurationException(
                f"PrecisionSchedule switches precision through MPPlugin, but this Trainer uses"
                f" {type(plugin).__name__} (precision={trainer.precision!r}). Use"
                " Trainer(plugins=[MPPlugin('fp32')], callbacks=[PrecisionSchedule(...)]) and leave"
                " Trainer(precision=...) unset."
            )
        if self._plugin is not None and plugin is not self._plugin:
            # a fit with another plugin is another run (its steps count from its own start): the schedule starts
            # afresh, as a new PrecisionSchedule would; a checkpoint given to fit then restores the saved state
            self._start_run()
        self._plugin = plugin
        device = trainer.strategy.root_device.type
        for name in {*self.schedule.values(), *self.fallback.values()}:
            try:
                resolve_mode(name, device)  # a mode this device cannot run fails now, not at step 500
            except (ValueError, NotImplementedError) as err:
                raise ValueError(f"PrecisionSchedule: cannot switch to {name!r} on {device!r}: {err}") from err
            try:  # one that training cannot switch to (true-half, fp8) fails now too
                plugin.check_precision_switch(name)
            except ValueError as err:
                raise ValueError(f"PrecisionSchedule: {err}") from err

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        plugin = self._require_plugin(trainer)
        if self.mode is None:
            self.mode = plugin.mode.name if plugin.mode is not None else plugin.requested_precision
        self._last_step = trainer.global_step
        self._counted_skips = plugin.stats.skipped_steps_known()  # (restored from a checkpoint by now)
        if self.interval == "step":
            self._apply_schedule(trainer, trainer.global_step)

    @override
    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.interval == "epoch":
            self._apply_schedule(trainer, trainer.current_epoch)

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        if step == self._last_step:
            return  # no optimizer step yet (gradient accumulation): never switch inside a step
        self._last_step = step
        plugin = self._require_plugin(trainer)
        if plugin.mode is not None and plugin.mode.name != self.mode:
            # switched outside the schedule (MPPlugin.set_precision): the skips seen belong to the previous mode
            self.mode = plugin.mode.name  # the plugin is the truth, whoever switched it
            self._forget_skips()
        if self.mode in self.fallback:
            self._observe_skips(plugin, step)
            recent = len(self._skips)  # all within the window (see _observe_skips)
            if recent >= self.max_skips:
                target = self.fallback[self.mode]
                self.abandoned.add(self.mode)
                reason = f"{recent} skipped steps within the last {self.window} (max_skips={self.max_skips})"
                self._switch(trainer, target, reason, warn=True)
        if self.interval == "step":
            self._apply_schedule(trainer, step)

    # ------------------------------------------------------------------ switching
    def _apply_schedule(self, trainer: Trainer, position: int) -> None:
        due = [k for k in self.schedule if self._applied < k <= position]
        if not due:
            return
        key = max(due)
        self._applied = key
        target = self.schedule[key]
        reason = f"schedule: from {self.interval} {key}"
        seen = {target}
        while target in self.abandoned and target in self.fallback and self.fallback[target] not in seen:
            reason += f" ({target!r} was abandoned after instability, so its fallback {self.fallback[target]!r})"
            target = self.fallback[target]
            seen.add(target)
        self._switch(trainer, target, reason)

    def _switch(self, trainer: Trainer, target: str, reason: str, warn: bool = False) -> None:
        plugin = self._require_plugin(trainer)
        current = plugin.mode.name if plugin.mode is not None else self.mode
        if target != AUTO and target == current:
            self.mode = current
            return
        mode = plugin.set_precision(target)  # between optimizer steps; raises before changing anything
        self.mode = mode.name
        self._forget_skips(plugin.stats.skipped_steps_known())
        if mode.name == current:
            return
        entry = {
            "step": int(trainer.global_step),
            "epoch": int(trainer.current_epoch),
            "from": current,
            "to": mode.name,
            "reason": reason,
        }
        self.history.append(entry)
        message = (
            f"PrecisionSchedule: precision {current!r} -> {mode.name!r} at global step {entry['step']} ({reason})."
        )
        if warn:
            rank_zero_warn(message)
        else:
            rank_zero_info(message)

    def _forget_skips(self, counted: Optional[int] = None) -> None:
        """A new mode: the skip window starts empty (the skips seen were the previous mode's); ``counted``: the
        plugin's skipped steps now (``None``: not known)."""
        self._skips.clear()
        self._counted_skips = counted

    def _observe_skips(self, plugin: Any, step: int) -> None:
        while self._skips and self._skips[0] <= step - self.window:
            self._skips.popleft()  # what is left are the skips within the window
        if not plugin.skips_nonfinite:
            return  # this mode runs without the inf/NaN guard: nothing is skipped
        stats = plugin.stats
        # every optimizer's skips since the last look (a GAN's discriminator too), counted
        total = stats.skipped_steps_known()  # never waits for the device
        if total is None:  # a fused optimizer's verdict on its way from the device
            if step % self.check_every_n_steps and self._counted_skips is not None:
                return
            total = stats.skipped_steps  # one host copy every check_every_n_steps steps
            fresh = 0 if self._counted_skips is None else total - self._counted_skips
        elif self._counted_skips is None:  # no count to start from (a switch made outside the schedule)
            fresh = int(stats.skipped_known() is True)  # the last step's verdict
        else:
            fresh = total - self._counted_skips
        if fresh > 0:
            self._skips.extend([step] * fresh)
        self._counted_skips = total

    def _require_plugin(self, trainer: Trainer) -> Any:
        plugin = trainer.precision_plugin
        if not _is_mpplugin(plugin):
            raise MisconfigurationException(f"PrecisionSchedule needs MPPlugin; found {type(plugin).__name__}.")
        self._plugin = plugin
        return plugin

    # ------------------------------------------------------------------ checkpoints
    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "history": [dict(h) for h in self.history],
            "abandoned": sorted(self.abandoned),
            "applied": self._applied,
            "skips": list(self._skips),
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        mode = state_dict.get("mode")
        self.history = [dict(h) for h in state_dict.get("history", [])]
        self.abandoned = {parse_precision(m) for m in state_dict.get("abandoned", [])}
        self._applied = int(state_dict.get("applied", -1))
        self._skips = deque(int(s) for s in state_dict.get("skips", []))
        self._counted_skips = None
        if mode is None:
            return
        self.mode = parse_precision(mode)
        if self._plugin is not None:
            # Lightning restores callbacks before the precision plugin: put the plugin in the saved mode first,
            # so that MPPlugin.load_state_dict finds the mode its checkpoint entry was written in.
            current = self._plugin.mode.name if self._plugin.mode is not None else None
            if current != self.mode:
                self._plugin.set_precision(self.mode)
                rank_zero_info(f"PrecisionSchedule: resuming in precision {self.mode!r} (from the checkpoint).")


def _key(key: Any, interval: str) -> int:
    if isinstance(key, str) and key.strip().isdigit():
        key = int(key)
    if isinstance(key, bool) or not isinstance(key, int) or key < 0:
        raise ValueError(
            f"schedule key {key!r} is invalid: use an integer {interval} >= 0, e.g. {{0: 'fp32', 500: 'bf16'}}."
        )
    return key


def _known(value: Any, what: str) -> str:
    try:
        return parse_precision(value)
    except ValueError as err:
        raise ValueError(f"{what}: {err}") from None


def _runnable(value: Any, what: str) -> str:
    return _known(value, f"{what}={value!r}")


def _is_mpplugin(plugin: Any) -> bool:
    """MPPlugin, known by what this callback uses of it (callbacks do not import the plugin)."""
    return isinstance(getattr(plugin, "stats", None), StepStats) and callable(getattr(plugin, "set_precision", None))
