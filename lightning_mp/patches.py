"""Every change the plugin makes to objects it does not own, each with its undo.

A run of ``MPPlugin`` changes these, and nothing else, outside its own objects:

=====================================  ==============================  =============================================
what                                   made by                         undone
=====================================  ==============================  =============================================
FP32 guards: a forward pre-hook, a     ``convert_module``              ``teardown`` (the guards this plugin put
forward hook, an instance ``forward``  (:mod:`lightning_mp.guards`)    there; inert on copies made during the run;
and an attribute on guarded modules                                    guards the user applied stay)
fp32 weights and buffers of the        ``convert_module`` in true-     ``teardown`` (cast to the half dtype, their
FP32-guarded modules                   half modes (:mod:`lightning_mp  fp32 values remembered for the next run and
                                       .master`)                       for checkpoints)
load-state hooks on the optimizers     ``connect`` in true-half modes  ``teardown`` (afterwards the optimizers load
(and those they wrap): a loaded state  with master weights             a state as torch's: cast to each parameter's
keeps fp32 for half parameters         (:mod:`lightning_mp.master`)    dtype)
``lr_scheduler_step`` on the           ``connect``                     ``teardown`` (the class's own entry
LightningModule's class: a descriptor  (:mod:`lightning_mp.schedulers`)
that holds the trained instance only                                   back once no instance is held)
TF32 flags (``torch.backends``)        ``connect`` (``tf32=`` or the   ``teardown`` (the values found before)
                                       mode's)
torch's global buffer and module      the first training step         ``teardown`` (the last run's end
registration hooks (a counter: a                                       removes them)
buffer or submodule registered
mid-run is snapshot too)
the FP8 backend's saturation watch     ``connect`` (fp8 with           ``teardown``
(its amax reduction, hooks on its FP8  saturation checks)
layers: :mod:`lightning_mp.fp8`)
=====================================  ==============================  =============================================

Not patches, and kept after the run as Lightning's own plugins keep them: true-half weights stay half (as
``precision="bf16-true"`` leaves them, the guarded modules' too), FP8 layers stay the backend's
(as Lightning's ``transformer-engine`` precision leaves them), and ``LightningModule.dtype`` reports the dtype the
weights were cast to. State that lives only while code runs (autocast, the default dtype in true-half modes, the
fp32 regions of guards) is entered and left by context managers, also when an exception unwinds them.

Lightning calls ``teardown`` after every entry point (``fit``, ``validate``, ``test``, ``predict``), also when the run
ends with an exception or an interrupt: afterwards the user's module is a plain module again.

The plugin itself pickles and deep-copies mid-run too (a copy keeps the counters, the loss scale and the master
weights, and holds none of these changes: no undo, no module, trainer or gradient hooks; it trains a run of its own).
What is set on the user's objects pickles and deep-copies: ``torch.save(pl_module)`` and ``copy.deepcopy(pl_module)``
mid-fit (checkpointing code, weight-averaging callbacks) work in every mode. Nothing of the scheduler hold is in the
module's ``__dict__``, so a copy calls its own ``lr_scheduler_step``, never held. The FP32 guards are objects bound to
the copy they are copied with (:mod:`lightning_mp.guards`), which work as the module's while the run lasts; the run's
guards share one mark, which the copies share too (a pickle finds it again while the run lasts), and ``teardown``
switches it off as it removes the trained module's guards: after the run a copy's guards are inert (the module's own
forward; :func:`~lightning_mp.guards.fp32_guard_of` sees none), and the next run or ``apply_fp32_guards`` removes
them. Guards the user applied are the user's in every copy. Parameters and optimizers carry nothing of ours into a
copy (torch leaves tensor hooks and an optimizer's hooks out of copies and pickles).

Example::

    patches = Patches()
    patches.add("lr_scheduler_step on MyModel", hold.remove)
    ...
    patches.undo_all()          # newest first; every undo runs, the first error is raised after the rest
"""

from __future__ import annotations

from typing import Callable


class Patches:
    """An ordered record of changes to other people's objects, undone newest first."""

    def __init__(self) -> None:
        self._undo: list[tuple[str, Callable[[], object]]] = []

    def __getstate__(self) -> dict[str, object]:
        """A copy (``pickle``, ``copy.deepcopy``: a plugin copied mid-run) is not the run that made these changes:
        it records none and undoes none (the original's teardown undoes them)."""
        return {"_undo": []}

    def add(self, what: str, undo: Callable[[], object]) -> None:
        """Record a change that was just made, with the callable that reverts it."""
        self._undo.append((what, undo))

    @property
    def applied(self) -> list[str]:
        """What is changed right now, oldest first."""
        return [what for what, _ in self._undo]

    def undo_all(self) -> None:
        """Revert every recorded change, newest first. Each undo runs even if an earlier one failed; the first
        failure is raised at the end, with the change it belongs to named."""
        failure: BaseException | None = None
        failed = ""
        while self._undo:
            what, undo = self._undo.pop()
            try:
                undo()
            except Exception as err:  # noqa: BLE001 - the rest must still be undone
                if failure is None:
                    failure, failed = err, what
        if failure is not None:
            raise RuntimeError(f"lightning_mp could not undo its change to {failed}: {failure}") from failure

    def __len__(self) -> int:
        return len(self._undo)

    def __repr__(self) -> str:
        return f"Patches({self.applied!r})"
