"""Convergence over seeds: does each precision mode train a GPT-mini as well as fp32?

Every mode trains the same byte-level GPT-mini (width 512, 8 layers, 8 heads, 256-byte context, linears without
biases: 25.58 M parameters) on the same text for ``--steps`` steps through a real ``lightning.pytorch.Trainer``
with ``MPPlugin(mode)``; each seed gives every mode the same initial weights (built under
``torch.manual_seed(seed)``, its ``state_dict`` loaded into each mode's fresh model) and the same batches (a seeded
generator). The validation loss on a fixed held-out set is recorded every ``--eval-every`` steps, and the summary
compares each mode's final validation loss with fp32's, in units of fp32's own spread over seeds.

The text ships with Python: the ``.py`` files of the standard library (``sysconfig.get_paths()["stdlib"]``; tests,
``idlelib``, ``turtledemo``, installed packages and the build's ``_sysconfigdata`` left out), in sorted path order,
as bytes (vocabulary 256). Every 20th file (5 %) is held out for validation. The corpus is the same on every
machine with the same Python version (about 11 MB on 3.11, 10 MB on 3.12); its byte count and SHA-256 are recorded
with every run, and a run directory refuses runs of another corpus or configuration.

Modes (``--modes``, default all): ``fp32``, ``tf32``, ``bf16``, ``fp16``, ``bf16-true`` (fp32 master weights),
``bf16-true:kahan``, ``bf16-true:stochastic``, ``bf16-true:none`` (the ``master_weights`` option), ``fp16-true``,
``fp8`` (bf16 weights with fp32 masters, delayed scaling: the defaults), ``fp8:bf16-weights`` (bf16 weights without
masters), ``fp8:fp32-weights``, ``fp8:current`` (current scaling), ``fp8:torchao-tensorwise``,
``fp8:torchao-rowwise`` and ``fp8:torchao-rowwise-gw-hp`` (the torchao backend; the last is torchao's
``rowwise_with_gw_hp``: rowwise, with the weight gradient's GEMM in high precision). Adam's moments in bf16
(``optimizer_states="bf16"``, stochastic rounding: :mod:`lightning_mp.optim_states`), spelt as
``python -m lightning_mp compare`` spells it, the option ``bf16-states`` (joined to another option by ``+``):
``bf16:bf16-states``, ``bf16-true:bf16-states`` (fp32 masters) and ``fp8:bf16-states`` (the fp8 defaults), each its
counterpart's plugin arguments with ``optimizer_states="bf16"`` added and nothing else. There is no masterless one:
MPPlugin refuses ``optimizer_states="bf16"`` with ``master_weights="none"``, where torch's AdamW keeps the moments
in the weights' dtype already (bf16, rounded to nearest): ``bf16-true:none`` is that case. Every fp8 mode passes
``fp8={"size_rule": "off"}``: at width 512 the default size rule would keep every layer out of FP8, and the
benchmark is meant to measure FP8 (the output layer stays in bf16, ``keep_last=1``; validation runs in bf16, the
plugin's default). A mode the machine cannot run is recorded as ``unsupported`` with the reason: fp8 without an
FP8-capable GPU (compute capability 8.9+) or Transformer Engine, tf32 on the CPU or below compute capability 8.0
(there it is fp32). fp16 and fp16-true do run on the CPU (slowly, with the same loss scaling), so a CPU run compares
them too.

Oracle modes, without lightning_mp: ``plain-torchao-tensorwise`` and ``plain-torchao-rowwise`` train the same model,
data and optimizer with Lightning's own ``Trainer(precision="bf16-mixed")`` (no MPPlugin) after torchao's public
``convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(recipe), module_filter_fn=...)`` on
the layers the fp8 modes convert (every ``nn.Linear`` but the output layer), each ``Float8Linear``'s forward
compiled on CUDA as the torchao backend compiles it for an uncompiled model, and validation through ``F.linear`` in
bf16 as the fp8 modes' (torchao's own layers would validate in FP8). What differs is lightning_mp's part: the
plugin's step and weight layout (the fp8 modes keep the FP8 layers' weights fp32 and the rest bf16 with fp32 master
weights; the plain modes keep every weight fp32 under autocast). A gap that the plain mode shows as well is the
recipe's, not lightning_mp's. They run where torchao's float8 runs: on the CPU (torch's FP8 matmul, uncompiled) and on
an FP8-capable GPU.

Every mode gets fused AdamW (betas 0.9/0.95, weight decay 0.1 on matrices; ``--no-fused``: foreach) with a linear
warm-up (``--warmup`` steps, at most a tenth of the run) and a cosine decay to 10 % of ``--lr`` (Lightning's
``lr_scheduler`` config, ``interval="step"``), and gradient clipping at ``--clip``. Attention is
``scaled_dot_product_attention``; TF32 is on only in the tf32 mode.

Recorded per (mode, seed), each run written to ``OUT/runs/<mode>__seed<k>.json`` as soon as it ends (``:`` in a
mode's name becomes ``_``): the validation-loss curve (step 0 too), the training loss (mean of every
``--log-every`` steps), skipped steps (``plugin.stats.skipped_steps``), wall time (synchronised: the training loop
with its evaluations, the training alone, and the whole ``fit``), the final validation loss and whether the run
diverged (a non-finite loss, or ``NonFiniteTrainingError``).

Run from the repository root::

    PYTHONPATH=. python benchmarks/convergence.py                        # all modes, seeds 0,1,2, 2000 steps
    PYTHONPATH=. python benchmarks/convergence.py --modes fp32,bf16 --seeds 0,1,2,3,4

The runs go seed by seed (every mode at seed 0, then seed 1, ...), so a visit cut short still compares every
mode, and ``--max-minutes N`` starts no run after N minutes. On an H200 a 2000-step run takes about 30-75 s
(16-36 ms a step, bound by host work at this size; the kahan and stochastic masters are the slowest), so the
default 21 modes x 3 seeds take about an hour run one at a time (``convergence_gpu.sh`` runs nine at once). On a
machine that allows 10 minutes a command, run the same command several
times, e.g. ``timeout 560 python benchmarks/convergence.py --max-minutes 7`` (a run started before minute 7 ends
in time, and ``timeout`` keeps the files written so far), and bring ``OUT`` back after each. Resume: the same
command with the same ``--out`` skips the runs whose JSON exists (an ``unsupported`` one is checked again, as
another machine may run it; delete a ``failed`` one's JSON to try it again).

Report: ``--report`` only reads ``OUT/runs/*.json`` and writes ``OUT/summary.json``, ``OUT/summary.md`` (the table)
and ``OUT/curves.png`` (validation loss, mean over seeds per mode, shaded min-max; needs matplotlib, skipped with a
message without it), so the plot can be made later on any machine from the JSON files; every training invocation
ends with it too. CPU smoke run (tiny model, under a second a run)::

    PYTHONPATH=. python benchmarks/convergence.py --device cpu --width 32 --layers 1 --heads 2 --seq-len 32 \\
        --steps 30 --eval-every 10 --eval-batches 4 --seeds 0,1 --modes fp32,bf16,bf16-true --threads 1 \\
        --out conv-smoke
    PYTHONPATH=. python benchmarks/convergence.py --report --out conv-smoke
"""

from __future__ import annotations

import argparse
import datetime
import functools
import gc
import glob
import hashlib
import json
import logging
import math
import os
import platform
import statistics
import sys
import sysconfig
import time
import warnings
from functools import lru_cache
from pathlib import Path
from typing import Any, Optional

import lightning
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import lightning_mp  # noqa: E402
from lightning_mp import FP8UnavailableError, MPPlugin  # noqa: E402
from lightning_mp.stats import NonFiniteTrainingError  # noqa: E402

#: mode label -> (precision, MPPlugin keyword arguments)
_FP8 = {"size_rule": "off"}
MODES: dict[str, tuple[str, dict[str, Any]]] = {
    "fp32": ("fp32", {}),
    "tf32": ("tf32", {}),
    "bf16": ("bf16", {}),
    "bf16:bf16-states": ("bf16", {"optimizer_states": "bf16"}),
    "fp16": ("fp16", {}),
    "bf16-true": ("bf16-true", {"master_weights": "fp32"}),
    "bf16-true:bf16-states": ("bf16-true", {"master_weights": "fp32", "optimizer_states": "bf16"}),
    "bf16-true:kahan": ("bf16-true", {"master_weights": "kahan"}),
    "bf16-true:stochastic": ("bf16-true", {"master_weights": "stochastic"}),
    "bf16-true:none": ("bf16-true", {"master_weights": "none"}),
    "fp16-true": ("fp16-true", {}),
    "fp8": ("fp8", {"fp8": dict(_FP8)}),  # (bf16 weights, fp32 masters, delayed scaling: the defaults)
    "fp8:bf16-states": ("fp8", {"fp8": dict(_FP8), "optimizer_states": "bf16"}),
    "fp8:bf16-weights": ("fp8", {"fp8": {**_FP8, "weights": "bf16"}, "master_weights": "none"}),
    "fp8:fp32-weights": ("fp8", {"fp8": {**_FP8, "weights": "fp32"}}),
    "fp8:current": ("fp8", {"fp8": {**_FP8, "recipe": "current"}}),
    "fp8:torchao-tensorwise": ("fp8", {"fp8": {**_FP8, "backend": "torchao", "recipe": "tensorwise"}}),
    "fp8:torchao-rowwise": ("fp8", {"fp8": {**_FP8, "backend": "torchao", "recipe": "rowwise"}}),
    "fp8:torchao-rowwise-gw-hp": ("fp8", {"fp8": {**_FP8, "backend": "torchao", "recipe": "rowwise_with_gw_hp"}}),
    # the oracles: Lightning's precision="bf16-mixed" (no MPPlugin) after torchao's own convert_to_float8_training
    "plain-torchao-tensorwise": ("lightning:bf16-mixed", {"torchao_recipe": "tensorwise"}),
    "plain-torchao-rowwise": ("lightning:bf16-mixed", {"torchao_recipe": "rowwise"}),
}
#: a finished run that a later invocation does not train again (``unsupported`` is checked again)
DONE = ("ok", "diverged", "failed")
#: the held-out share of the corpus: every VAL_EVERY-th file (sorted by path)
VAL_EVERY = 20
_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idlelib", "turtledemo", "__pycache__"}


# --------------------------------------------------------------------------------------------- corpus
@lru_cache(maxsize=1)
def load_corpus() -> dict[str, Any]:
    """The standard library's ``.py`` files as bytes: ``train`` and ``val`` (uint8 tensors) and their facts."""
    root = Path(sysconfig.get_paths()["stdlib"])
    paths = []
    for directory, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in _SKIP_DIRS and not d.startswith("config-"))
        paths += [Path(directory, f) for f in sorted(files) if f.endswith(".py") and not f.startswith("_sysconfigdata")]
    paths.sort(key=lambda p: p.relative_to(root).as_posix())
    train, val = [], []
    for i, path in enumerate(paths):
        (val if i % VAL_EVERY == VAL_EVERY - 1 else train).append(path.read_bytes())
    train_bytes, val_bytes = b"\n".join(train), b"\n".join(val)
    digest = hashlib.sha256(train_bytes + b"\0" + val_bytes).hexdigest()
    return {
        "train": torch.frombuffer(bytearray(train_bytes), dtype=torch.uint8),
        "val": torch.frombuffer(bytearray(val_bytes), dtype=torch.uint8),
        "facts": {
            "source": "Python standard library .py files (sorted by path; every 20th file held out)",
            "python": platform.python_version(),
            "files": len(paths), "val_files": len(val),
            "bytes": len(train_bytes) + len(val_bytes), "train_bytes": len(train_bytes), "val_bytes": len(val_bytes),
            "sha256": digest,
        },
    }


class Windows(Dataset):
    """Batch ``i``: the windows starting at ``starts[i]`` (``(batch,)`` offsets), as ``(x, y)`` byte ids."""

    def __init__(self, data: torch.Tensor, starts: torch.Tensor, seq_len: int) -> None:
        self.data, self.starts, self.span = data, starts, torch.arange(seq_len + 1)

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = self.data[self.starts[i][:, None] + self.span].long()
        return chunk[:, :-1], chunk[:, 1:]


def train_starts(n_bytes: int, steps: int, batch: int, seq_len: int, seed: int) -> torch.Tensor:
    """The batch order of a seed: ``(steps, batch)`` random window offsets, the same for every mode."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, n_bytes - seq_len - 1, (steps, batch), generator=g)


def val_starts(n_bytes: int, batches: int, batch: int, seq_len: int) -> torch.Tensor:
    """The fixed validation set: ``batches * batch`` windows spread evenly over the held-out text."""
    return torch.linspace(0, n_bytes - seq_len - 1, batches * batch).long().view(batches, batch)


# --------------------------------------------------------------------------------------------- model
class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        # no biases in the linears (as in most current LLMs): fewer tensors, less host time a step
        self.qkv, self.proj = nn.Linear(width, 3 * width, bias=False), nn.Linear(width, width, bias=False)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width, bias=False), nn.GELU(approximate="tanh"),
                                 nn.Linear(4 * width, width, bias=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.norm2(x))


class GPTMini(LightningModule):
    """Byte-level causal GPT: learned positions, pre-norm blocks, GELU MLPs, an untied output layer."""

    def __init__(self, width: int, layers: int, heads: int, seq_len: int, cfg: dict[str, Any],
                 train: Optional[Dataset] = None, val: Optional[Dataset] = None) -> None:
        super().__init__()
        self.embed = nn.Embedding(256, width)
        self.pos = nn.Parameter(torch.zeros(seq_len, width))
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, 256, bias=False)
        self.cfg, self.train_set, self.val_set = cfg, train, val
        self.val_losses: list[torch.Tensor] = []
        #: gradient clipping done here, not by the Trainer (the oracle modes: see ``on_before_optimizer_step``)
        self.clip_in_hook = 0.0
        for name, p in self.named_parameters():  # GPT-2's initialisation
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif p.dim() >= 2:
                residual = name.endswith(("proj.weight", "mlp.2.weight"))
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * layers) if residual else 0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) + self.pos[: x.shape[1]]
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))

    def _loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self(x).float().flatten(0, 1), y.flatten())

    def training_step(self, batch, batch_idx):
        return self._loss(batch)

    def validation_step(self, batch, batch_idx):
        self.val_losses.append(self._loss(batch).detach())

    def on_before_optimizer_step(self, optimizer):
        # Lightning's own bf16-mixed refuses gradient_clip_val with a fused optimizer (its fp16 rule); the oracle
        # modes clip here, where the Trainer would (after this hook, before the step), with the same norm
        if self.clip_in_hook:
            torch.nn.utils.clip_grad_norm_([p for g in optimizer.param_groups for p in g["params"]], self.clip_in_hook)

    def configure_optimizers(self):
        cfg = self.cfg
        params = [p for p in self.parameters() if p.requires_grad]
        groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg["weight_decay"]},
                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
        optimizer = torch.optim.AdamW(groups, lr=cfg["lr"], betas=(0.9, 0.95), fused=cfg["fused"])
        warmup, total, floor = cfg["warmup"], cfg["steps"], cfg["min_lr_ratio"]

        def factor(step: int) -> float:
            if step < warmup:
                return (step + 1) / warmup
            progress = min(1.0, (step - warmup) / max(1, total - warmup))
            return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def train_dataloader(self):
        return DataLoader(self.train_set, batch_size=None, shuffle=False)

    def val_dataloader(self):
        return DataLoader(self.val_set, batch_size=None, shuffle=False)


def count_parameters(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


# --------------------------------------------------------------------------------------------- one run
class Recorder(Callback):
    """Per-step training losses (kept on the device, read once at the end), the validation curve and the times."""

    def __init__(self, steps: int, cuda: bool) -> None:
        self.steps, self.cuda = steps, cuda
        self.losses: Optional[torch.Tensor] = None
        self.seen = 0  # batches trained (the first ``seen`` entries of ``losses`` are real)
        self.val: list[tuple[int, Optional[float]]] = []
        self.t_start = self.t_end = self.t_val = 0.0
        self.eval_s = 0.0

    def _now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    def on_train_start(self, trainer, pl_module):
        self.losses = torch.full((self.steps,), math.nan, device=pl_module.device)
        self.t_start = self._now()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.losses is not None and batch_idx < self.steps:
            self.losses[batch_idx] = outputs["loss"].detach()
            self.seen = batch_idx + 1

    def on_train_end(self, trainer, pl_module):
        self.t_end = self._now()

    def on_validation_start(self, trainer, pl_module):
        self.t_val = self._now()

    def on_validation_epoch_end(self, trainer, pl_module):
        value = torch.stack(pl_module.val_losses).mean().item() if pl_module.val_losses else math.nan
        pl_module.val_losses.clear()
        self.val.append((trainer.global_step, value if math.isfinite(value) else None))

    def on_validation_end(self, trainer, pl_module):
        if not trainer.sanity_checking:
            self.eval_s += self._now() - self.t_val


def unsupported_reason(mode: str, device: str) -> Optional[str]:
    """Why this machine cannot run ``mode`` (see the module docstring), or ``None``."""
    precision, kwargs = MODES[mode]
    if precision == "tf32":
        if device != "cuda":
            return "TF32 is a tensor-core format of NVIDIA GPUs (compute capability 8.0+); on the CPU it is fp32"
        if torch.cuda.get_device_capability()[0] < 8:
            return "TF32 needs compute capability 8.0 or newer; on this GPU it is fp32"
    if precision == "fp8":
        from lightning_mp.fp8.backend import make_backend

        try:
            make_backend(kwargs["fp8"]).check(device)
        except Exception as err:  # FP8UnavailableError, or Transformer Engine failing to import
            return f"{type(err).__name__}: {err}"
    if "torchao_recipe" in kwargs:  # torchao's float8 runs on the CPU too (torch's FP8 matmul there)
        from lightning_mp.fp8.torchao_backend import torchao_support_facts, torchao_support_problem

        try:
            import torchao.float8  # noqa: F401
        except Exception as err:  # not installed, or built for another torch
            return f"torchao's float8 cannot be imported: {type(err).__name__}: {err}"
        if device == "cuda":
            return torchao_support_problem(**torchao_support_facts(device, kwargs["torchao_recipe"]))
    return None


def plain_torchao(model: nn.Module, recipe: str, compile_layers: bool) -> int:
    """torchao's own float8 training on ``model``, without lightning_mp (the oracle modes); returns how many layers.

    ``convert_to_float8_training`` with ``Float8LinearConfig.from_recipe_name(recipe)`` on every ``nn.Linear`` but the
    output layer ``head`` (the fp8 modes' layers: ``size_rule="off"``, ``keep_last=1``; every width here divides by
    16). With ``compile_layers`` each ``Float8Linear``'s forward is compiled, one compiled function a layer shape (as
    the torchao backend does for a model that is not compiled). Outside training the layers compute ``F.linear`` in
    the autocast dtype, as the fp8 modes validate (``fp8_in_eval=False``).
    """
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = Float8LinearConfig.from_recipe_name(recipe)
    convert_to_float8_training(model, config=config,
                               module_filter_fn=lambda module, fqn: isinstance(module, nn.Linear) and fqn != "head")
    layers = [m for m in model.modules() if type(m).__name__ == "Float8Linear"]
    compiled: dict[tuple[int, int], Any] = {}
    for layer in layers:
        forward = type(layer).forward
        if compile_layers:
            key = (layer.in_features, layer.out_features)
            forward = compiled[key] = compiled.get(key) or torch.compile(forward)
        layer.forward = functools.partial(_plain_float8_forward, layer, forward)
    return len(layers)


def _plain_float8_forward(layer: nn.Module, fp8_forward: Any, x: torch.Tensor) -> torch.Tensor:
    if layer.training:
        return fp8_forward(layer, x)
    return F.linear(x, layer.weight, layer.bias)  # validation in bf16 (autocast), as the fp8 modes'


def run_config(args: argparse.Namespace, corpus: dict[str, Any]) -> dict[str, Any]:
    """What makes two runs comparable (a run directory holds runs of one configuration)."""
    return {
        "steps": args.steps, "width": args.width, "layers": args.layers, "heads": args.heads,
        "seq_len": args.seq_len, "batch_size": args.batch_size, "lr": args.lr, "warmup": warmup_steps(args),
        "min_lr_ratio": 0.1, "weight_decay": 0.1, "fused": not args.no_fused, "clip": args.clip,
        "eval_every": args.eval_every, "eval_batches": args.eval_batches, "log_every": args.log_every,
        "corpus_sha256": corpus["facts"]["sha256"],
    }


def warmup_steps(args: argparse.Namespace) -> int:
    return max(1, min(args.warmup, args.steps // 10))


def device_name(device: str) -> str:
    return torch.cuda.get_device_name() if device == "cuda" else (platform.processor() or platform.machine() or "CPU")


def train_one(mode: str, seed: int, args: argparse.Namespace, corpus: dict[str, Any], initial: dict[str, torch.Tensor],
              cfg: dict[str, Any], device: str) -> dict[str, Any]:
    """One (mode, seed) run through a real Trainer; every failure lands in the returned record."""
    precision, kwargs = MODES[mode]
    record: dict[str, Any] = {
        "mode": mode, "precision": precision, "plugin_kwargs": kwargs, "seed": seed, "status": "ok", "reason": None,
        "config": cfg, "corpus": corpus["facts"], "device": device_name(device), "device_type": device,
        "torch": torch.__version__, "lightning": lightning.__version__, "lightning_mp": lightning_mp.__version__,
        "python": platform.python_version(), "concurrent_runs": args.concurrent,
    }
    why = unsupported_reason(mode, device)
    if why is not None:
        record.update(status="unsupported", reason=why)
        return record
    if precision == "fp8":
        from lightning_mp.fp8.support import te_version

        record["transformer_engine"] = te_version()
    if kwargs.get("torchao_recipe") or kwargs.get("fp8", {}).get("backend") == "torchao":
        from lightning_mp.fp8.torchao_backend import torchao_version

        record["torchao"] = torchao_version()
    train = Windows(corpus["train"], train_starts(len(corpus["train"]), args.steps, args.batch_size, args.seq_len,
                                                  seed), args.seq_len)
    val = Windows(corpus["val"], val_starts(len(corpus["val"]), args.eval_batches, args.batch_size, args.seq_len),
                  args.seq_len)
    torch.manual_seed(seed)  # nothing in a run draws random numbers, but a mode's own set-up may
    model = GPTMini(args.width, args.layers, args.heads, args.seq_len, cfg, train, val)
    model.load_state_dict(initial)
    cuda = device == "cuda"
    recorder = Recorder(args.steps, cuda)
    plugin: Optional[MPPlugin] = None
    if precision.startswith("lightning:"):  # an oracle mode: Lightning's own precision, torchao's own layers
        precision_kwargs: dict[str, Any] = {"precision": precision.split(":", 1)[1]}
        record["float8_layers"] = plain_torchao(model, kwargs["torchao_recipe"], compile_layers=cuda)
        model.clip_in_hook, clip = args.clip, None
        record["plugin"] = f"Trainer(precision={precision_kwargs['precision']!r}), torchao convert_to_float8_training"
    else:
        plugin = MPPlugin(precision, **kwargs)
        precision_kwargs, clip = {"plugins": [plugin]}, args.clip or None
        record["plugin"] = repr(plugin)
    trainer = Trainer(
        accelerator="gpu" if cuda else "cpu", devices=1, **precision_kwargs, max_steps=args.steps,
        val_check_interval=args.eval_every, check_val_every_n_epoch=None, num_sanity_val_steps=args.eval_batches,
        gradient_clip_val=clip, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[recorder],
    )
    t0 = time.perf_counter()
    try:
        trainer.fit(model)
    except NonFiniteTrainingError as err:
        record.update(status="diverged", reason=f"NonFiniteTrainingError: {err}")
    except FP8UnavailableError as err:  # what the up-front check could not see (a recipe, a layer's shape)
        record.update(status="unsupported", reason=f"FP8UnavailableError: {err}")
    except Exception as err:  # a mode that breaks is a result, not the end of the benchmark
        record.update(status="failed", reason=f"{type(err).__name__}: {err}")
    try:
        if cuda:
            torch.cuda.synchronize()
        losses = recorder.losses[: recorder.seen].tolist() if recorder.losses is not None else []
    except RuntimeError as err:  # a failed run can leave the device unusable: keep what the host knows
        record.update(status="failed", reason=record["reason"] or f"{type(err).__name__}: {err}")
        losses = []
    record["fit_s"] = time.perf_counter() - t0
    every = max(1, args.log_every)
    record["train"] = [[min(i + every, len(losses)), _mean_or_none(losses[i : i + every])]
                       for i in range(0, len(losses), every)]
    record["nonfinite_train_losses"] = sum(1 for x in losses if not math.isfinite(x))
    record["val"] = [list(point) for point in recorder.val]
    record["skipped_steps"] = plugin.stats.skipped_steps if plugin is not None else 0  # (Lightning skips none)
    record["steps_done"] = trainer.global_step
    record["wall_s"] = recorder.t_end - recorder.t_start if recorder.t_end else None
    record["eval_s"] = recorder.eval_s
    record["train_s"] = record["wall_s"] - recorder.eval_s if record["wall_s"] is not None else None
    record["ms_per_step"] = 1e3 * record["train_s"] / max(1, trainer.global_step) if record["train_s"] else None
    final = recorder.val[-1] if recorder.val and recorder.val[-1][0] == args.steps else None
    record["final_val_loss"] = final[1] if final else None
    record["final_val_bits_per_byte"] = final[1] / math.log(2) if final and final[1] is not None else None
    nonfinite = any(v is None for _, v in recorder.val) or record["final_val_loss"] is None
    if record["status"] == "ok" and nonfinite:
        record.update(status="diverged", reason="non-finite validation loss")
    record["diverged"] = record["status"] == "diverged"
    record["finished"] = datetime.datetime.now().isoformat(timespec="seconds")
    del trainer, model, plugin
    gc.collect()  # the next run starts with the memory of this one given back
    if cuda:
        torch.cuda.empty_cache()
    return record


def _mean_or_none(values: list[float]) -> Optional[float]:
    """The mean, or ``None`` where a value is not finite (JSON has no inf or NaN)."""
    mean = sum(values) / len(values) if values else math.nan
    return mean if math.isfinite(mean) else None


# --------------------------------------------------------------------------------------------- files
def run_path(out: Path, mode: str, seed: int) -> Path:
    return out / "runs" / f"{mode.replace(':', '_')}__seed{seed}.json"


def read_runs(out: Path) -> list[dict[str, Any]]:
    runs = []
    for path in sorted(glob.glob(str(out / "runs" / "*.json"))):
        with open(path) as f:
            runs.append(json.load(f))
    return runs


def write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, path)  # a run interrupted while writing leaves no half file behind


# --------------------------------------------------------------------------------------------- summary
def _fmt(value: Optional[float], spec: str = ".4f") -> str:
    return "—" if value is None else format(value, spec)


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per mode: the final validation loss over seeds (mean, std, min-max), its distance from fp32's mean in
    fp32 seed standard deviations, skipped steps and times."""
    order = {m: i for i, m in enumerate(MODES)}
    by_mode: dict[str, list[dict[str, Any]]] = {}
    for run in sorted(runs, key=lambda r: (order.get(r["mode"], len(order)), r["mode"], r["seed"])):
        by_mode.setdefault(run["mode"], []).append(run)
    rows = []
    for mode, group in by_mode.items():
        trained = [r for r in group if r["status"] != "unsupported"]
        finals = [r["final_val_loss"] for r in trained if r["status"] == "ok" and r["final_val_loss"] is not None]
        row: dict[str, Any] = {
            "mode": mode, "seeds": sorted(r["seed"] for r in trained), "runs": len(trained),
            "diverged": sum(r["status"] == "diverged" for r in trained),
            "failed": sum(r["status"] == "failed" for r in trained),
            "final_val_loss_mean": statistics.fmean(finals) if finals else None,
            "final_val_loss_std": statistics.stdev(finals) if len(finals) > 1 else None,
            "final_val_loss_min": min(finals) if finals else None,
            "final_val_loss_max": max(finals) if finals else None,
            "skipped_steps_mean": statistics.fmean(r["skipped_steps"] for r in trained) if trained else None,
            "skipped_steps_max": max((r["skipped_steps"] for r in trained), default=None),
            "wall_s_mean": _mean_of(trained, "wall_s"), "ms_per_step_mean": _mean_of(trained, "ms_per_step"),
            "devices": sorted({r["device"] for r in trained}),
            "status": "unsupported" if not trained else ("ok" if len(finals) == len(trained) else "mixed"),
            "reason": next((r["reason"] for r in group if r["reason"]), None),
        }
        rows.append(row)
    base = next((r for r in rows if r["mode"] == "fp32"), None)
    for row in rows:
        row["delta_vs_fp32"] = row["delta_vs_fp32_sigma"] = None
        if base and base["final_val_loss_mean"] is not None and row["final_val_loss_mean"] is not None:
            row["delta_vs_fp32"] = row["final_val_loss_mean"] - base["final_val_loss_mean"]
            if base["final_val_loss_std"]:
                row["delta_vs_fp32_sigma"] = row["delta_vs_fp32"] / base["final_val_loss_std"]
    configs = {json.dumps(r["config"], sort_keys=True) for r in runs}
    first = runs[0] if runs else {}
    return {
        "date": datetime.date.today().isoformat(),
        "devices": sorted({r["device"] for r in runs if r["status"] != "unsupported"}),
        "config": first.get("config"), "configs": len(configs), "corpus": first.get("corpus"),
        "params": first.get("params"), "torch": sorted({r["torch"] for r in runs}),
        "lightning": sorted({r["lightning"] for r in runs}), "rows": rows,
    }


def _mean_of(runs: list[dict[str, Any]], key: str) -> Optional[float]:
    values = [r[key] for r in runs if r.get(key) is not None]
    return statistics.fmean(values) if values else None


def summary_markdown(summary: dict[str, Any]) -> str:
    cfg, corpus = summary["config"] or {}, summary["corpus"] or {}
    devices = ", ".join(summary["devices"]) or "no device (every mode unsupported)"
    params = summary.get("params")
    lines = [
        f"# Convergence over seeds — {devices}, {summary['date']}",
        "",
        f"GPT-mini ({_fmt(params / 1e6 if params else None, '.2f')} M parameters: width {cfg.get('width')}, "
        f"depth {cfg.get('layers')}, {cfg.get('heads')} heads, {cfg.get('seq_len')}-byte context), "
        f"{cfg.get('steps')} steps of {cfg.get('batch_size')} x {cfg.get('seq_len')} bytes, AdamW lr {cfg.get('lr')} "
        f"(warm-up {cfg.get('warmup')}, cosine), clip {cfg.get('clip')}; torch {', '.join(summary['torch'])}, "
        f"lightning {', '.join(summary['lightning'])}.",
        f"Corpus: {corpus.get('source')}, Python {corpus.get('python')}, {corpus.get('bytes')} bytes "
        f"({corpus.get('val_bytes')} held out), sha256 {str(corpus.get('sha256'))[:16]}. Validation loss in nats "
        f"per byte on {cfg.get('eval_batches')} x {cfg.get('batch_size')} fixed held-out windows.",
        "",
        "| mode | seeds | final val loss mean | std | min–max | Δ vs fp32 | Δ / fp32 std | diverged | skipped steps "
        "(mean, max) | wall s (mean) | ms/step |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    notes = []
    for row in summary["rows"]:
        if row["status"] == "unsupported":
            notes.append(f"{row['mode']}: {row['reason']}")
            lines.append(f"| {row['mode']} | — | unsupported [{len(notes)}] | | | | | | | | |")
            continue
        spread = (f"{row['final_val_loss_min']:.4f}–{row['final_val_loss_max']:.4f}"
                  if row["final_val_loss_min"] is not None else "—")
        delta = _fmt(row["delta_vs_fp32"], "+.4f")
        sigma = _fmt(row["delta_vs_fp32_sigma"], "+.2f")
        diverged = f"{row['diverged']}/{row['runs']}" + (f" ({row['failed']} failed)" if row["failed"] else "")
        if row["reason"] and row["status"] != "ok":
            notes.append(f"{row['mode']}: {row['reason']}")
            diverged += f" [{len(notes)}]"
        lines.append(
            f"| {row['mode']} | {','.join(map(str, row['seeds']))} | {_fmt(row['final_val_loss_mean'])} | "
            f"{_fmt(row['final_val_loss_std'])} | {spread} | {delta} | {sigma} | {diverged} | "
            f"{_fmt(row['skipped_steps_mean'], '.1f')}, {row['skipped_steps_max']} | "
            f"{_fmt(row['wall_s_mean'], '.1f')} | {_fmt(row['ms_per_step_mean'], '.1f')} |"
        )
    if summary["configs"] > 1:
        lines += ["", f"Warning: the runs hold {summary['configs']} different configurations; the header shows one."]
    lines += [""] + [f"[{i}] {note}" for i, note in enumerate(notes, 1)] if notes else []
    return "\n".join(lines) + "\n"


def plot_curves(runs: list[dict[str, Any]], path: Path, title: str) -> Optional[str]:
    """Validation loss per mode (mean over seeds, shaded min-max): full run and its second half. ``None``, or
    why no plot was made."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not importable here: no plot (run --report where it is)"
    curves: dict[str, dict[int, list[float]]] = {}
    for run in runs:
        if run["status"] == "unsupported":
            continue
        for step, value in run.get("val", []):
            if value is not None:
                curves.setdefault(run["mode"], {}).setdefault(step, []).append(value)
    if not curves:
        return "no validation curves to plot"
    order = {m: i for i, m in enumerate(MODES)}
    colours = plt.get_cmap("tab20").colors  # (the dark shades first, then the light ones)
    fig, axes = plt.subplots(1, 2, figsize=(14, 5.5))
    last = max(step for c in curves.values() for step in c)
    for i, mode in enumerate(sorted(curves, key=lambda m: order.get(m, len(order)))):
        steps = sorted(curves[mode])
        mean = [statistics.fmean(curves[mode][s]) for s in steps]
        low, high = [min(curves[mode][s]) for s in steps], [max(curves[mode][s]) for s in steps]
        style = ":" if mode.startswith("plain-") else "--" if ":" in mode else "-"
        for ax, start in ((axes[0], 0), (axes[1], last // 2)):
            keep = [j for j, s in enumerate(steps) if s >= start]
            xs = [steps[j] for j in keep]
            colour = colours[(2 * i + i // 10) % 20]
            ax.plot(xs, [mean[j] for j in keep], style, color=colour, label=mode, lw=1.4)
            ax.fill_between(xs, [low[j] for j in keep], [high[j] for j in keep], color=colour, alpha=0.2, lw=0)
    axes[0].set_title("validation loss (mean over seeds, shaded min–max)")
    axes[1].set_title(f"from step {last // 2}")
    for ax in axes:
        ax.set_xlabel("step")
        ax.set_ylabel("validation loss (nats/byte)")
        ax.grid(alpha=0.3)
    finals = [v for c in curves.values() for s, vs in c.items() if s >= last // 2 for v in vs]
    if finals:
        pad = 0.05 * (max(finals) - min(finals) or 0.1)
        axes[1].set_ylim(min(finals) - pad, max(finals) + pad)
    axes[1].legend(fontsize=8, ncol=2)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


def report(out: Path, quiet: bool = False) -> dict[str, Any]:
    """Write ``summary.json``, ``summary.md`` and ``curves.png`` from ``OUT/runs/*.json``; print the table."""
    runs = read_runs(out)
    summary = summarise(runs)
    write_json(out / "summary.json", summary)
    text = summary_markdown(summary)
    (out / "summary.md").write_text(text, encoding="utf-8")
    cfg = summary["config"] or {}
    title = (f"GPT-mini {cfg.get('width')}x{cfg.get('layers')}, {cfg.get('steps')} steps, "
             f"{', '.join(summary['devices'])}, {summary['date']}")
    why = plot_curves(runs, out / "curves.png", title) if runs else "no runs"
    if not quiet:
        print()
        print(text, end="")
        print(f"written: {out / 'summary.md'}, {out / 'summary.json'}"
              + (f"; plot skipped: {why}" if why else f", {out / 'curves.png'}"))
    return summary


# --------------------------------------------------------------------------------------------- main
def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=2000, help="optimizer steps per run (default 2000)")
    p.add_argument("--seeds", default="0,1,2", help="comma list of seeds (default 0,1,2)")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma list (default all: {','.join(MODES)})")
    p.add_argument("--eval-every", type=int, default=200, help="validation every N steps (default 200)")
    p.add_argument("--eval-batches", type=int, default=32, help="validation batches (default 32)")
    p.add_argument("--log-every", type=int, default=50, help="training loss recorded as the mean of N steps")
    p.add_argument("--batch-size", type=int, default=16, help="sequences per step (default 16)")
    p.add_argument("--lr", type=float, default=1e-3, help="peak AdamW learning rate (default 1e-3)")
    p.add_argument("--warmup", type=int, default=100, help="warm-up steps (at most steps/10; default 100)")
    p.add_argument("--no-fused", action="store_true", help="AdamW's foreach implementation instead of the fused one")
    p.add_argument("--clip", type=float, default=1.0, help="gradient-norm clipping (0: none; default 1.0)")
    p.add_argument("--width", type=int, default=512, help="model width (default 512)")
    p.add_argument("--layers", type=int, default=8, help="transformer blocks (default 8)")
    p.add_argument("--heads", type=int, default=8, help="attention heads (default 8)")
    p.add_argument("--seq-len", type=int, default=256, help="context in bytes (default 256)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads for the run (default: torch's)")
    p.add_argument("--out", default=os.path.join("benchmarks", "results", "convergence"),
                   help="run directory (default benchmarks/results/convergence)")
    p.add_argument("--concurrent", type=int, default=1,
                   help="how many runs share the device (recorded with each run: wall times compare only at equal N)")
    p.add_argument("--max-minutes", type=float, default=None, help="start no new run after this many minutes")
    p.add_argument("--report", action="store_true", help="only write the summary and the plot from OUT/runs")
    args = p.parse_args(argv)
    unknown = [m for m in args.modes.split(",") if m not in MODES]
    if unknown:
        p.error(f"unknown mode(s) {', '.join(unknown)}; choose from {', '.join(MODES)}")
    if args.eval_every < 1 or args.steps % args.eval_every:
        p.error(f"--steps {args.steps} must be a multiple of --eval-every {args.eval_every} (the last evaluation is "
                "the final validation loss)")
    if args.width % args.heads:
        p.error(f"--width {args.width} is not divisible by --heads {args.heads}")
    return args


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    """Train the missing (mode, seed) runs, then write the summary; returns the summary with ``trained`` (the
    runs trained by this invocation) and ``already_done`` added."""
    args = parse_args(argv)
    if args.report:
        return report(Path(args.out))
    loggers = [logging.getLogger(name) for name in ("lightning.pytorch", "lightning.fabric", "lightning_mp")]
    levels, threads = [logger.level for logger in loggers], torch.get_num_threads()
    if args.threads:
        torch.set_num_threads(args.threads)
    with warnings.catch_warnings():  # quiet: one line a run, then the table (the caller's settings come back)
        warnings.simplefilter("ignore")
        for logger in loggers:
            logger.setLevel(logging.ERROR)
        try:
            return _train_and_report(args)
        finally:
            for logger, level in zip(loggers, levels):
                logger.setLevel(level)
            torch.set_num_threads(threads)


def _train_and_report(args: argparse.Namespace) -> dict[str, Any]:
    out = Path(args.out)
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    corpus = load_corpus()
    cfg = run_config(args, corpus)
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    modes = args.modes.split(",")
    facts = corpus["facts"]
    started, trained, done = time.perf_counter(), [], []
    todo = []
    for seed in seeds:  # seed-major: a visit cut short still has every mode at the first seeds
        for mode in modes:
            path = run_path(out, mode, seed)
            if path.exists():
                with open(path) as f:
                    old = json.load(f)
                if old["config"] != cfg:
                    changed = sorted(k for k in set(cfg) | set(old["config"]) if cfg.get(k) != old["config"].get(k))
                    raise SystemExit(f"{path} holds a run of another configuration ({', '.join(changed)} differ): "
                                     "use another --out, or the same settings")
                if old["status"] in DONE:
                    done.append(f"{mode}/seed{seed}")
                    continue
            todo.append((mode, seed))
    params = count_parameters(GPTMini(args.width, args.layers, args.heads, args.seq_len, cfg))
    print(f"GPT-mini {params / 1e6:.2f} M parameters; corpus {facts['bytes']} bytes "
          f"({facts['files']} files, {facts['val_bytes']} held out), sha256 {facts['sha256'][:16]}; "
          f"{device_name(device)}; {len(todo)} run(s) to do, {len(done)} already done", flush=True)
    initial: dict[int, dict[str, torch.Tensor]] = {}
    for i, (mode, seed) in enumerate(todo):
        minutes = (time.perf_counter() - started) / 60
        if args.max_minutes is not None and minutes >= args.max_minutes:
            print(f"stopped after {minutes:.1f} min (--max-minutes): {len(todo) - i} run(s) left; the same command "
                  "resumes them", flush=True)
            break
        if seed not in initial:
            torch.manual_seed(seed)
            initial = {seed: GPTMini(args.width, args.layers, args.heads, args.seq_len, cfg).state_dict()}
        record = train_one(mode, seed, args, corpus, initial[seed], cfg, device)
        record["params"] = params
        write_json(run_path(out, mode, seed), record)
        trained.append(f"{mode}/seed{seed}")
        if record["status"] == "unsupported":
            print(f"{mode:>20} seed {seed}: unsupported ({record['reason'][:100]})", flush=True)
        elif record["status"] == "failed":
            print(f"{mode:>20} seed {seed}: failed ({record['reason'][:160]})", flush=True)
        else:
            print(f"{mode:>20} seed {seed}: final val {_fmt(record['final_val_loss'])}"
                  f"{' DIVERGED' if record['diverged'] else ''}, {record['skipped_steps']} skipped, "
                  f"{_fmt(record['wall_s'], '.1f')} s ({_fmt(record['ms_per_step'], '.1f')} ms/step)", flush=True)
    summary = report(out)
    summary["trained"], summary["already_done"] = trained, done
    return summary


if __name__ == "__main__":
    main()
