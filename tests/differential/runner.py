"""Runs a :class:`~programs.Program` through the real Lightning ``Trainer`` on the CPU and collects its final state.

The data: batch ``i`` of the program without a poisoned step (its *logical* batch ``i``) is a fixed function of the
program's seed and ``i``. Batches are served by a sampler that starts wherever the module's cursor stands (the count
of batches ``training_step`` has taken, saved in checkpoints), so every entry point (a second ``fit``, a resume into
a fresh Trainer) continues the same stream whatever Lightning does with its dataloader iterators. A poisoned program
serves the same stream with one extra accumulation window inserted (its batches tagged -1, one of them holding a
NaN); write callbacks are keyed to the logical batches, so both programs see the same writes between the same
steps. Every batch carries its tag, and the run records the tags ``training_step`` saw: the oracles first check that
the stream was what the program meant (the generator's own check).
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import math
import tempfile
import warnings
from pathlib import Path
from typing import Any, Optional

import torch
import torch.nn.functional as F
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.plugins import MixedPrecision
from torch import nn
from torch.utils.data import DataLoader, Dataset, Sampler

from lightning_mp import MPPlugin

from .programs import SCALED, Program, Write

FEATURES = 8
BATCH = 4
CLASSES = 4
#: the sampler's length: one epoch that never ends within a program (an epoch end would step a short window)
ENDLESS = 10**6
INIT_SCALE = 2.0**8  # fp16 modes, ours and Lightning's: clean steps of these tiny models never overflow
LR = {"sgd": 0.05, "adam": 0.01, "adamw-foreach": 0.01, "adamw-fused": 0.01}  # lookahead-adam: Adam's
CLIP = {"norm": 0.1, "value": 0.02}  # small enough that clipping acts on most steps
LIGHTNING_PRECISION = {"fp32": "32-true", "bf16": "bf16-mixed", "fp16": "16-mixed", "bf16-true": "bf16-true",
                       "fp16-true": "16-true"}


# ---------------------------------------------------------------------------------------------- the data
def _generator(*key: int) -> torch.Generator:
    return torch.Generator().manual_seed(hash(key) & 0x7FFF_FFFF_FFFF)


def logical_batch(program: Program, i: int, tag: Optional[int] = None) -> tuple[torch.Tensor, ...]:
    g = _generator(program.seed, i)
    x = torch.randn(BATCH, FEATURES, generator=g)
    if program.loss == "weighted-ce":
        y = torch.randint(0, CLASSES, (BATCH,), generator=g)
    else:
        y = x[:, :3].sum(1, keepdim=True) + 0.1 * torch.randn(BATCH, 1, generator=g)
    return x, y, torch.tensor(i if tag is None else tag)


class Stream(Dataset):
    """Physical batch ``i`` of the program: the logical stream with the poisoned window (if any) inserted."""

    def __init__(self, program: Program) -> None:
        self.program = program

    def __len__(self) -> int:
        return ENDLESS

    def __getitem__(self, i: int) -> tuple[torch.Tensor, ...]:
        p = self.program
        if p.poison is None:
            return logical_batch(p, i)
        start = p.poison.window * p.accumulate
        if i < start:
            return logical_batch(p, i)
        if i >= start + p.accumulate:
            return logical_batch(p, i - p.accumulate)
        x, y, tag = logical_batch(p, ENDLESS + i, tag=-1)  # other data than any logical batch
        if i - start == p.poison.micro:
            x, y = x.clone(), y.clone()
            if p.poison.where == "input":
                x[1, 2] = math.nan
            else:
                y[1, 0] = math.nan
        return x, y, tag


class CursorSampler(Sampler):
    """Indices from the module's cursor on: a new iterator (a new fit, a resume) continues where training stopped."""

    def __init__(self, module: "DiffNet") -> None:
        self.module = module

    def __len__(self) -> int:
        return ENDLESS

    def __iter__(self):
        return iter(range(self.module.cursor, ENDLESS))


# ---------------------------------------------------------------------------------------------- an optimizer wrapper
class Lookahead(torch.optim.Optimizer):
    """timm's ``Lookahead`` as it is written there: a wrapper that shares its base optimizer's param groups and
    state, never runs ``Optimizer.__init__``, and every ``k`` steps pulls the weights towards slow copies kept in
    the base optimizer's state (a write to the weights inside the optimizer's step)."""

    def __init__(self, base: torch.optim.Optimizer, alpha: float = 0.5, k: int = 2) -> None:
        # (no super().__init__(), as in timm)
        self._optimizer_step_pre_hooks: dict = collections.OrderedDict()
        self._optimizer_step_post_hooks: dict = collections.OrderedDict()
        defaults = dict(lookahead_alpha=alpha, lookahead_k=k, lookahead_step=0)
        self._base_optimizer = base
        self.param_groups = base.param_groups
        self.defaults = base.defaults
        self.defaults.update(defaults)
        self.state = collections.defaultdict(dict)
        for name, default in defaults.items():
            for group in base.param_groups:
                group.setdefault(name, default)

    @torch.no_grad()
    def update_slow(self, group: dict) -> None:
        for fast in group["params"]:
            if fast.grad is None:
                continue
            state = self._base_optimizer.state[fast]
            if "lookahead_slow_buff" not in state:
                state["lookahead_slow_buff"] = torch.empty_like(fast)
                state["lookahead_slow_buff"].copy_(fast)
            slow = state["lookahead_slow_buff"]
            slow.add_(fast - slow, alpha=group["lookahead_alpha"])
            fast.copy_(slow)

    @torch.no_grad()
    def step(self, closure=None):
        loss = self._base_optimizer.step(closure)
        for group in self._base_optimizer.param_groups:
            group["lookahead_step"] += 1
            if group["lookahead_step"] % group["lookahead_k"] == 0:
                self.update_slow(group)
        return loss

    def state_dict(self):
        return self._base_optimizer.state_dict()

    def load_state_dict(self, state_dict) -> None:
        self._base_optimizer.load_state_dict(state_dict)
        self.param_groups = self._base_optimizer.param_groups


# ---------------------------------------------------------------------------------------------- the module
class DiffNet(LightningModule):
    """l1 -> [BatchNorm] -> tanh -> [ema / calls buffers re-assigned] -> [LayerNorm] -> l2 -> tanh -> head."""

    def __init__(self, program: Program, tags: list) -> None:
        super().__init__()
        self.program = program
        self.tags = tags  # shared by every module of one run (a resume makes a new one)
        self.cursor = 0
        with torch.random.fork_rng(devices=[]):  # nn.Linear's own init draws from the global RNG
            # no bias ahead of BatchNorm (it cancels it): its gradient would be rounding noise, which Adam scales up
            # to lr-sized steps in random directions, and no tolerance tells such drift from a bug
            self.l1 = nn.Linear(FEATURES, FEATURES, bias=not program.batchnorm)
            self.bn = nn.BatchNorm1d(FEATURES) if program.batchnorm else None
            self.ln = nn.LayerNorm(FEATURES) if program.layernorm else None
            self.l2 = nn.Linear(FEATURES, FEATURES)
            self.head = nn.Linear(FEATURES, CLASSES if program.loss == "weighted-ce" else 1)
        g = _generator(program.seed, -1)
        with torch.no_grad():
            for name, p in self.named_parameters():
                norm = name.startswith(("bn.", "ln."))
                p.copy_((1.0 if norm and name.endswith("weight") else 0.0) + 0.4 * torch.randn(p.shape, generator=g))
        if program.tie == "linear":
            self.l2.weight = self.l1.weight
        elif program.tie == "norms":
            self.ln.weight = self.bn.weight
        if program.ema is not None:
            self.register_buffer("ema", torch.zeros(FEATURES), persistent=program.ema == "persistent")
        if program.calls:
            self.register_buffer("calls", torch.zeros((), dtype=torch.int64))
        self.criterion = (
            nn.CrossEntropyLoss(weight=torch.tensor([1.0, 2.0, 0.5, 1.5])) if program.loss == "weighted-ce" else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.l1(x)
        if self.bn is not None:
            h = self.bn(h)
        h = torch.tanh(h)
        if self.training and self.program.ema is not None:
            self.ema = 0.9 * self.ema + 0.1 * h.detach().mean(0)
        if self.training and self.program.calls:
            self.calls = self.calls + 1
        if self.ln is not None:
            h = self.ln(h)
        return self.head(torch.tanh(self.l2(h)))

    def _loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out = self(x)
        if self.criterion is not None:
            # the weight's dtype: fp32 under autocast and in a guarded loss module, bf16/fp16 in Lightning's true-half
            return self.criterion(out.to(self.criterion.weight.dtype), y)
        return F.mse_loss(out.float(), y.float())

    def training_step(self, batch, batch_idx):
        x, y, tag = batch
        self.cursor += 1
        self.tags.append(int(tag))
        return self._loss(x, y)

    def validation_step(self, batch, batch_idx):
        x, y, _ = batch
        self.log("val_loss", self._loss(x, y))

    def configure_optimizers(self):
        p = self.program
        eps = 1e-4 if p.mode == "fp16-true" else 1e-8  # Adam's 1e-8 is 0 in fp16 (fp16 state without masters)
        if p.optimizer == "sgd":
            opt = torch.optim.SGD(self.parameters(), lr=LR["sgd"], momentum=0.9)
        elif p.optimizer == "adam":
            opt = torch.optim.Adam(self.parameters(), lr=LR["adam"], eps=eps)
        elif p.optimizer == "lookahead-adam":
            opt = Lookahead(torch.optim.Adam(self.parameters(), lr=LR["adam"], eps=eps))
        elif p.optimizer == "adamw-foreach":
            opt = torch.optim.AdamW(self.parameters(), lr=LR["adamw-foreach"], eps=eps, foreach=True)
        else:
            opt = torch.optim.AdamW(self.parameters(), lr=LR["adamw-fused"], eps=eps, fused=True)
        if not p.scheduler:
            return opt
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.8)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def train_dataloader(self):
        return DataLoader(Stream(self.program), batch_size=None, sampler=CursorSampler(self))

    def val_dataloader(self):
        batches = [logical_batch(self.program, -2 - i) for i in range(2)]
        return DataLoader(batches, batch_size=None)

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["differential_cursor"] = self.cursor

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        self.cursor = checkpoint["differential_cursor"]


# ---------------------------------------------------------------------------------------------- weight writes
def write_weights(module: DiffNet, write: Write) -> None:
    """Writes weights the ways users do between steps."""
    params = [module.l1.weight] if write.target == "l1" else list(module.parameters())
    if write.op in ("load_state_dict", "reload"):
        ptrs = {p.data_ptr() for p in params}
        scale = 0.5 if write.op == "load_state_dict" else 1.0
        state = module.state_dict()
        module.load_state_dict({k: v * scale if v.data_ptr() in ptrs else v for k, v in state.items()})
        return
    for p in params:
        if write.op == "mul":
            with torch.no_grad():
                p.mul_(0.5)
        elif write.op in ("clamp", "clamp-wide"):
            bound = 0.1 if write.op == "clamp" else 100.0  # (no weight comes near 100: the values stay)
            p.data.clamp_(-bound, bound)
        elif write.op == "rows":
            p.data[:2] = 0.25
        elif write.op == "copy":
            with torch.no_grad():
                p.copy_(p.flip(0) * 0.75)
        elif write.op == "copy-same":
            with torch.no_grad():
                p.copy_(p.detach().clone())
        else:
            raise ValueError(f"write op {write.op!r}")


class WeightWriter(Callback):
    """Applies the program's writes at ``on_train_batch_start``/``_end`` of their logical batches."""

    def __init__(self, writes: tuple[Write, ...]) -> None:
        self.writes = writes

    def _apply(self, module: DiffNet, batch, hook: str) -> None:
        tag = int(batch[2])
        for write in self.writes:
            if write.hook == hook and write.at == tag:
                write_weights(module, write)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._apply(pl_module, batch, "start")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self._apply(pl_module, batch, "end")


# ------------------------------------------------------------------------------------------ how a run is made precise
@dataclasses.dataclass(frozen=True)
class Side:
    """Our plugin (``plugin`` holds MPPlugin's arguments beyond the mode) or Lightning's ``precision``."""

    lightning: Optional[str] = None  # Lightning's precision flag; None: ours
    plugin: tuple[tuple[str, Any], ...] = ()

    @staticmethod
    def ours(program: Program, **overrides: Any) -> "Side":
        kwargs: dict[str, Any] = {}
        if program.master_weights is not None:
            kwargs["master_weights"] = program.master_weights
        if program.guards == "off":
            kwargs["fp32_modules"] = ()  # (a tuple: a Side is hashable; made a list for MPPlugin)
        if program.mode in SCALED:
            kwargs["init_scale"] = INIT_SCALE
        kwargs.update(overrides)
        return Side(plugin=tuple(sorted(kwargs.items())))

    def trainer_kwargs(self, program: Program) -> dict[str, Any]:
        if self.lightning is None:
            kwargs = {k: list(v) if isinstance(v, tuple) else v for k, v in self.plugin}
            return {"plugins": [MPPlugin(program.mode, **kwargs)]}
        if self.lightning == "16-mixed":  # Lightning's fp16 with our initial scale (its own default is 2**16)
            scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE)
            return {"plugins": [MixedPrecision("16-mixed", "cpu", scaler=scaler)]}
        return {"precision": self.lightning}


# ---------------------------------------------------------------------------------------------- the run
@dataclasses.dataclass
class Final:
    """What a run ends with."""

    params: dict[str, torch.Tensor]
    buffers: dict[str, torch.Tensor]
    optimizer: dict
    scheduler: Optional[dict]
    global_step: int
    tags: list[int]
    validations: list[float] = dataclasses.field(default_factory=list)  # what each validate entry logged
    steps: Optional[int] = None  # plugin.stats (ours)
    skipped: Optional[int] = None
    masters: Optional[dict] = None  # plugin.masters.state_dict() (ours, true-half)
    scaler: Optional[dict] = None
    error: Optional[str] = None  # an exception the run raised (a finding of its own)


def _trainer(program: Program, side: Side, max_steps: int, callbacks: list) -> Trainer:
    kwargs: dict[str, Any] = dict(
        accelerator="cpu", devices=1, max_steps=max_steps, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, callbacks=callbacks,
        accumulate_grad_batches=program.accumulate, deterministic=False,
    )
    if program.clip is not None:
        kwargs.update(gradient_clip_val=CLIP[program.clip], gradient_clip_algorithm=program.clip)
    kwargs.update(side.trainer_kwargs(program))
    return Trainer(**kwargs)


def physical_steps(program: Program, logical: int) -> int:
    """``max_steps`` that brings the program to its ``logical``-th step: the poisoned window, taken before it,
    counts as an optimizer step (Lightning counts it: the plugin skips inside the step)."""
    poison = program.poison
    return logical + (1 if poison is not None and poison.window < logical else 0)


def run(program: Program, side: Side) -> Final:
    tags: list[int] = []
    validations: list[float] = []
    callbacks = [WeightWriter(program.writes)] if program.writes else []
    model = DiffNet(program, tags)
    trainer: Optional[Trainer] = None
    logical = 0
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's advice about workers, resuming mid-epoch, ...
        for entry in program.entries:
            if entry.kind == "fit":
                logical += entry.steps
                if trainer is None:
                    trainer = _trainer(program, side, physical_steps(program, logical), callbacks)
                else:
                    trainer.fit_loop.epoch_loop.max_steps = physical_steps(program, logical)
                trainer.fit(model)
            elif entry.kind == "validate":
                validations.append(float(trainer.validate(model, verbose=False)[0]["val_loss"]))
            elif entry.kind == "resume":
                path = Path(tmp) / f"resume-{logical}.ckpt"
                trainer.save_checkpoint(path)
                logical += entry.steps
                model = DiffNet(program, tags)
                callbacks = [WeightWriter(program.writes)] if program.writes else []
                trainer = _trainer(program, side, physical_steps(program, logical), callbacks)
                trainer.fit(model, ckpt_path=path)
            else:
                raise ValueError(f"entry {entry.kind!r}")
    final = collect(trainer, model, tags)
    final.validations = validations
    return final


def collect(trainer: Trainer, model: DiffNet, tags: list[int]) -> Final:
    opt = trainer.optimizers[0]
    configs = trainer.lr_scheduler_configs
    final = Final(
        params={n: p.detach().clone() for n, p in model.named_parameters()},
        buffers={n: b.detach().clone() for n, b in model.named_buffers()},
        optimizer=copy.deepcopy(opt.state_dict()),
        scheduler=copy.deepcopy(configs[0].scheduler.state_dict()) if configs else None,
        global_step=trainer.global_step,
        tags=list(tags),
    )
    plugin = trainer.precision_plugin
    if isinstance(plugin, MPPlugin):
        final.steps, final.skipped = plugin.stats.steps, plugin.stats.skipped_steps
        if plugin.masters is not None:
            final.masters = copy.deepcopy(plugin.masters.state_dict())
        if plugin.scaler is not None:
            final.scaler = copy.deepcopy(plugin.scaler.state_dict())
    return final
