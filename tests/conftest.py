"""Tiny LightningModules and helpers shared by the CPU tests."""

from __future__ import annotations

import copy
import math
import os
import time
from pathlib import Path
from typing import Optional

import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_mp import cpu


#: The whole suite's time in minutes, as README.md and docs/development.md state it: measured with `make test` on a
#: 2-core x86 CPU (AMD EPYC, a shared cloud machine, as quiet as it could be had: 5-minute load average 1.1-2.8) with
#: native bf16 (AVX512-BF16), 3.3-3.7 min (3,259 tests, 2026-11-29), and on the same CPU with native bf16 held back
#: as on a CPU with AVX2 alone (ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2), 3.3 min (3.8 min for the smaller
#: suite of 2026-11-28). Other work on the machine made it 4-18 min.
#: `make test` sets LIGHTNING_MP_SUITE_BUDGET=1 and holds a run of the whole suite to them, so that they stay true
#: without failing CI, or a user's first `make test`, on a machine of unknown speed. The figure is first scaled to this
#: machine: by how much slower than on the machine of the figures it runs a small fp32 training loop, timed before the
#: suite and after it (the slower of the two: other work that starts during the suite shows; MACHINE_PACE_S; never
#: scaled down). Then:
#: - up to the figure plus a quarter (SUITE_REPORT_OVER): nothing is said;
#: - beyond that, up to twice the figure (SUITE_FAIL_OVER): it is reported, and the run still passes;
#: - beyond twice the figure, a gross regression: the run fails, except where the time says nothing of the suite,
#:   on a machine busy with other work (a 5-minute load average above 1.5 a core at the end) or with a single core,
#:   where it is reported instead.
SUITE_MINUTES = {"native bf16": 4, "no native bf16": 4}
SUITE_REPORT_OVER = 1.25
SUITE_FAIL_OVER = 2.0
SUITE_BUSY_LOAD_PER_CORE = 1.5
#: machine_pace() on the machine of SUITE_MINUTES, quiet (seconds; 0.076 there, 0.15-0.17 with other work on it)
MACHINE_PACE_S = 0.076
TESTS = Path(__file__).resolve().parent


def machine_pace() -> float:
    """Seconds this machine takes for a fixed small fp32 training loop (100 Adam steps of a 3-layer MLP of width 256,
    batch 128: host work and small matrix multiplies, as in most of the suite), the best of three (or the first, where
    it took ten times MACHINE_PACE_S): 0.076 s each on the machine of the figures."""
    generator = torch.Generator().manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    x, y = torch.randn(128, 256, generator=generator), torch.randn(128, 1, generator=generator)
    best = math.inf
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(100):
            optimizer.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
        best = min(best, time.perf_counter() - start)
        if best > 10 * MACHINE_PACE_S:  # slow enough to say so: no need to spend more (a busy machine: minutes)
            break
    return best


def _whole_suite_timed(config: pytest.Config) -> bool:
    return os.environ.get("LIGHTNING_MP_SUITE_BUDGET") == "1" and [Path(a).resolve() for a in config.args] == [TESTS] \
        and not config.option.keyword and not config.option.markexpr and not config.option.deselect


def pytest_sessionstart(session: pytest.Session) -> None:
    config = session.config
    config._lightning_mp_slower = 1.0  # type: ignore[attr-defined]
    if _whole_suite_timed(config):
        with torch.random.fork_rng():
            config._lightning_mp_slower = max(1.0, machine_pace() / MACHINE_PACE_S)  # type: ignore[attr-defined]
    config._lightning_mp_started = time.monotonic()  # type: ignore[attr-defined]


def suite_over_budget(
    minutes: float, kind: str, load: float, cores: int, slower: float = 1.0
) -> Optional[tuple[bool, str]]:
    """``None`` when a whole-suite run of ``minutes`` on a CPU of ``kind`` is within its stated figure (scaled by
    ``slower``, how much slower this machine is than that of the figures) plus a quarter; else whether it fails
    (beyond twice the figure, on a machine not busy: ``load``, the 5-minute load average, at most 1.5 a core, and
    more than one core) and what to say."""
    stated = SUITE_MINUTES[kind] * slower
    if minutes <= stated * SUITE_REPORT_OVER:
        return None
    scaled = f", scaled by {slower:.1f} for this machine's speed," if slower > 1.05 else ""
    said = (
        f"the whole suite took {minutes:.1f} min on this CPU ({kind}, {cores} cores, load average {load:.1f}): more"
        f" than README.md's {SUITE_MINUTES[kind]} min{scaled} plus a quarter ({stated * SUITE_REPORT_OVER:.1f} min)"
    )
    update = "measure the suite on 2 quiet cores and update SUITE_MINUTES (tests/conftest.py), README.md and" \
        " docs/development.md"
    limit = stated * SUITE_FAIL_OVER
    if minutes <= limit:
        return False, f"{said}; reported, not failed (a run fails beyond twice the figure, {limit:.1f} min): {update}."
    if load > SUITE_BUSY_LOAD_PER_CORE * cores:
        return False, f"{said}, and beyond twice it; not failed: the machine is busy with other work."
    if cores < 2:
        return False, f"{said}, and beyond twice it; not failed: the figure is for 2 cores, this machine has 1."
    return True, f"{said}, and beyond twice it ({limit:.1f} min): make the slow tests faster, or {update}."


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    config = session.config
    if not _whole_suite_timed(config) or exitstatus != 0:
        return
    kind = "native bf16" if REAL_CPU_CAPABILITY().bf16 else "no native bf16"
    minutes = (time.monotonic() - config._lightning_mp_started) / 60  # type: ignore[attr-defined]
    with torch.random.fork_rng():  # (the machine may have got busier since the suite began)
        slower = max(config._lightning_mp_slower, machine_pace() / MACHINE_PACE_S)  # type: ignore[attr-defined]
    verdict = suite_over_budget(minutes, kind, os.getloadavg()[1], os.cpu_count() or 1, slower)
    if verdict is None:
        return
    fails, said = verdict
    reporter = config.pluginmanager.getplugin("terminalreporter")
    if reporter is not None:
        reporter.ensure_newline()
        reporter.write_line(said, red=fails, yellow=not fails)
    if fails:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_configure(config: pytest.Config) -> None:
    # fp16 on the CPU (bf16 too, without native bf16) warns at set-up that another mode is faster there; the CPU
    # tests run them on purpose
    config.addinivalue_line("filterwarnings", "ignore::lightning_mp.modes.PerformanceWarning")


def make_data(n: int = 64, features: int = 16, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, features, generator=g)
    w = torch.randn(features, 1, generator=g)
    y = x @ w + 0.1 * torch.randn(n, 1, generator=g)
    return TensorDataset(x, y)


class TinyRegressor(LightningModule):
    """A two-layer MLP on a fixed regression set, with hooks to poison chosen batches.

    Args:
        poison_loss: batch indices (Lightning's ``total_batch_idx``: counted over the whole run, restored on
            resume) whose loss is multiplied by ``poison_value``.
        poison_grad: batch indices whose first weight gradient gets one ``poison_value`` element.
        poison_activation: batch indices whose hidden activation gets one ``poison_value`` element.
        batches_by_index: take each training batch by the global batch index instead of the DataLoader's.
    """

    def __init__(
        self,
        optimizer: str = "sgd",
        lr: float = 0.05,
        scheduler: bool = False,
        poison_loss: tuple[int, ...] = (),
        poison_grad: tuple[int, ...] = (),
        poison_activation: tuple[int, ...] = (),
        poison_value: float = math.inf,
        manual: bool = False,
        manual_clip: Optional[float] = None,
        batch_size: int = 8,
        n: int = 64,
        batches_by_index: bool = False,
    ) -> None:
        super().__init__()
        self.net1 = nn.Linear(16, 32)
        self.net2 = nn.Linear(32, 1)
        self.optimizer_name = optimizer
        self.lr = lr
        self.use_scheduler = scheduler
        self.poison_loss = set(poison_loss)
        self.poison_grad = set(poison_grad)
        self.poison_activation = set(poison_activation)
        self.poison_value = poison_value
        self.automatic_optimization = not manual
        self.manual_clip = manual_clip
        self.batch_size = batch_size
        self.n = n
        self.batches_by_index = batches_by_index
        self.batches_seen = 0
        self.losses: list[float] = []
        self.seen_dtypes: list[torch.dtype] = []

    @property
    def batch_index(self) -> int:
        return self.trainer.fit_loop.epoch_loop.total_batch_idx

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.net1(x))
        self.seen_dtypes.append(h.dtype)
        if self.training and self.batch_index in self.poison_activation:
            h = h.clone()
            h[0, 0] = self.poison_value
        return self.net2(h)

    def _loss(self, batch) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self(x).float(), y.float())
        if self.training and self.batch_index in self.poison_loss:
            loss = loss * self.poison_value
        return loss

    def training_step(self, batch, batch_idx):
        if self.batches_by_index:
            # Lightning restarts a plain DataLoader on resume; taking the batch by the restored global batch
            # index makes an interrupted run see exactly the batches of an uninterrupted one
            x, y = make_data(self.n).tensors
            per_epoch = self.n // self.batch_size
            start = (self.batch_index % per_epoch) * self.batch_size
            batch = (x[start : start + self.batch_size], y[start : start + self.batch_size])
        loss = self._loss(batch)
        self.losses.append(float(loss.detach()))
        if self.automatic_optimization:
            self.batches_seen += 1
            return loss
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(loss)
        self._poison_grads()
        if self.manual_clip is not None:
            self.clip_gradients(opt, gradient_clip_val=self.manual_clip, gradient_clip_algorithm="norm")
        opt.step()
        self.batches_seen += 1
        return None

    def on_after_backward(self) -> None:
        if self.automatic_optimization:
            self._poison_grads()

    def _poison_grads(self) -> None:
        if self.batch_index in self.poison_grad and self.net1.weight.grad is not None:
            self.net1.weight.grad[0, 0] = self.poison_value

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self._loss(batch))

    def configure_optimizers(self):
        if self.optimizer_name == "sgd":
            opt = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
        elif self.optimizer_name == "adam":
            opt = torch.optim.Adam(self.parameters(), lr=self.lr * 0.2)
        elif self.optimizer_name == "adamw_fused":
            opt = torch.optim.AdamW(self.parameters(), lr=self.lr * 0.2, fused=True)
        elif self.optimizer_name == "adamw_foreach":
            opt = torch.optim.AdamW(self.parameters(), lr=self.lr * 0.2, foreach=True)
        else:
            raise ValueError(self.optimizer_name)
        if not self.use_scheduler:
            return opt
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def train_dataloader(self):
        return DataLoader(make_data(self.n), batch_size=self.batch_size, shuffle=False)

    def val_dataloader(self):
        return DataLoader(make_data(16, seed=1), batch_size=8)


class StepRecorder(Callback):
    """Snapshots parameters, optimizer state and LR before and after every optimizer step."""

    def __init__(self) -> None:
        self.before: list[dict] = []
        self.after: list[dict] = []

    @staticmethod
    def snapshot(trainer: Trainer, module: LightningModule) -> dict:
        opt = trainer.optimizers[0]
        return {
            "params": {k: v.detach().clone() for k, v in module.named_parameters()},
            "opt_state": copy.deepcopy(opt.state_dict()["state"]),
            "lr": opt.param_groups[0]["lr"],
        }

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.before.append(self.snapshot(trainer, pl_module))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.after.append(self.snapshot(trainer, pl_module))


def assert_state_equal(a: dict, b: dict) -> None:
    for name in a["params"]:
        assert torch.equal(a["params"][name], b["params"][name]), f"parameter {name} changed"
    assert_nested_equal(a["opt_state"], b["opt_state"])
    assert a["lr"] == b["lr"]


def assert_nested_equal(a, b) -> None:
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert_nested_equal(a[k], b[k])
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b)
    else:
        assert a == b


def make_trainer(plugin=None, max_steps: int = 8, callbacks=(), **kwargs) -> Trainer:
    defaults = dict(
        accelerator="cpu",
        devices=1,
        max_steps=max_steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
    )
    defaults.update(kwargs)
    return Trainer(plugins=[plugin] if plugin is not None else None, callbacks=list(callbacks), **defaults)


@pytest.fixture
def check_passes(monkeypatch) -> list:
    """Counts the separate inf/NaN gradient passes of MPPlugin's check-only scaler (one entry per pass)."""
    from lightning_mp import verdict
    from lightning_mp.verdict import PlannedCheck

    calls: list = []
    inside: list = []  # (check_grads_ runs the planned check itself: one pass, counted once)
    original = verdict.check_grads_

    def check_grads_(opt, found):
        calls.append(1)
        inside.append(1)
        try:
            return original(opt, found)
        finally:
            inside.pop()

    monkeypatch.setattr(verdict, "check_grads_", check_grads_)
    planned = PlannedCheck.found_inf

    def found_inf(self, flag):  # the check planned once (lightning_mp.step's check-only plans)
        found = planned(self, flag)
        if found is not None and not inside:
            calls.append(1)
        return found

    monkeypatch.setattr(PlannedCheck, "found_inf", found_inf)
    return calls


@pytest.fixture(autouse=True)
def _seed():
    seed_everything(0, workers=True)
    yield


#: this machine's CPU as lightning_mp reads it (tests/test_cpu_capability.py checks the reader itself)
REAL_CPU_CAPABILITY = cpu.cpu_capability
#: the CPU every other test sees: one with native bf16, so that what 'auto' picks on the CPU and which modes warn
#: there do not depend on the machine that runs the suite; a test of another CPU passes its own CpuCapability
NATIVE_BF16_CPU = cpu.CpuCapability("AVX512", bf16=True, how="AVX512-BF16")


@pytest.fixture(autouse=True)
def _cpu_with_native_bf16(monkeypatch):
    monkeypatch.setattr(cpu, "cpu_capability", lambda: NATIVE_BF16_CPU)


class ForkLauncher(_MultiProcessingLauncher):
    """Lightning's fork launcher for sharded strategies (FSDP, ModelParallel) in tests: rank 0's module state is
    its shard, so nothing is loaded back into the parent; the tests read what each rank saved instead."""

    def _recover_results_in_main_process(self, worker_output, trainer) -> None:
        if worker_output.weights_path is not None:
            self._strategy.checkpoint_io.remove_checkpoint(worker_output.weights_path)
        super()._recover_results_in_main_process(worker_output._replace(weights_path=None), trainer)


class CPUFSDPStrategy(FSDPStrategy):
    """Lightning's FSDPStrategy, launched by fork (a test harness: Lightning only lets FSDP run on CUDA)."""

    def _configure_launcher(self) -> None:
        self._launcher = ForkLauncher(self, start_method="fork")

    def _setup_model(self, model):
        # as FSDPStrategy._setup_model, with the CPU named explicitly (torch's FSDP wants a device id for it)
        from torch.distributed.fsdp import FullyShardedDataParallel

        return FullyShardedDataParallel(
            module=model, mixed_precision=self.mixed_precision_config, device_id=torch.device("cpu"), **self.kwargs
        )


class ForkModelParallel(ModelParallelStrategy):
    """Lightning's ModelParallelStrategy (FSDP2), launched by fork instead of its script launcher."""

    def _configure_launcher(self) -> None:
        self._launcher = ForkLauncher(self, start_method="fork")
