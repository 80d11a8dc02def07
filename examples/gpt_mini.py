"""GPT-mini: a small byte-level GPT trained on Python's own standard-library source, under MPPlugin.

The text is always there offline: the source files of a handful of standard-library modules (or, with
``--data.source=stdlib``, every ``.py`` file of the standard library, about 11 MB). The vocabulary is the
256 byte values. The model is a decoder-only transformer: pre-norm blocks, causal attention through
``torch.nn.functional.scaled_dot_product_attention``, GELU MLPs, learned positions, and the output layer tied
to the token embedding.

CPU (the default size, 0.8 M parameters: validation bits per byte fall from 8 to about 1.7 in the 1,000 steps, and
the greedy sample turns into Python, e.g. ``def __repr__(self):``; 2.5 minutes on 2 cores of a CPU with native bf16;
on a CPU without it bf16 runs many times slower than fp32: use the fp32 config there, about 3.5 minutes.
docs/getting-started.md has the times, docs/modes.md "On a CPU" the penalty)::

    python -m examples.gpt_mini fit --config examples/configs/gpt_mini_bf16.yaml
    python -m examples.gpt_mini fit --config examples/configs/gpt_mini_fp16.yaml --trainer.max_steps=200

GPU (about 85 M parameters, the whole standard library; pick the config of the precision to try)::

    python -m examples.gpt_mini fit --config examples/configs/gpt_mini_bf16.yaml \\
        --model.width=768 --model.depth=12 --model.heads=12 --model.context=1024 --model.lr=6e-4 \\
        --data.source=stdlib --data.seq_len=1024 --data.batch_size=32 --data.num_workers=4 \\
        --trainer.max_steps=5000 --trainer.limit_val_batches=50

Resume from the saved config and a checkpoint (the same plugin and loss-scale state come back)::

    python -m examples.gpt_mini fit --config lightning_logs/gpt_mini_bf16/version_0/config.yaml \\
        --ckpt_path lightning_logs/gpt_mini_bf16/version_0/checkpoints/last.ckpt

Each YAML file under ``examples/configs/`` sets ``trainer.plugins`` to ``lightning_mp.MPPlugin`` with one
precision and adds ``lightning_mp.PrecisionMonitor``; ``--print_config`` shows every argument.
"""

from __future__ import annotations

import importlib.util
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING, Literal, Optional

import torch
from lightning.pytorch import LightningDataModule, LightningModule
from torch import nn

if TYPE_CHECKING:
    from lightning_mp.tools.cli import MPLightningCLI
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset


#: standard-library modules whose source is the default corpus (about 720 kB on Python 3.11)
DEFAULT_MODULES = (
    "argparse", "collections", "dataclasses", "enum", "functools",
    "inspect", "logging", "pathlib", "textwrap", "typing",
)
_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idlelib", "__pycache__", "turtledemo"}


# ------------------------------------------------------------------------------------------------ data
def module_sources(modules: tuple[str, ...] | list[str]) -> list[tuple[str, bytes]]:
    """``(name, source bytes)`` of each importable standard-library module that ships its ``.py`` file."""
    found = []
    for name in modules:
        spec = importlib.util.find_spec(name)
        origin = getattr(spec, "origin", None)
        if origin and origin.endswith(".py") and os.path.isfile(origin):
            found.append((name, Path(origin).read_bytes()))
    return found


def stdlib_sources() -> list[tuple[str, bytes]]:
    """Every ``.py`` file of the standard library (tests and third-party packages left out), in path order."""
    root = Path(os.__file__).parent
    found = []
    for directory, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in _SKIP_DIRS)
        for name in sorted(files):
            if name.endswith(".py"):
                path = Path(directory, name)
                found.append((str(path.relative_to(root)), path.read_bytes()))
    return found


class ByteWindows(Dataset):
    """Non-overlapping windows of a byte string: ``(x, y)`` with ``y`` the next byte of each ``x`` byte.

    Example::

        ds = ByteWindows(torch.arange(100, dtype=torch.uint8), seq_len=8)
        x, y = ds[0]   # x = bytes 0..7, y = bytes 1..8
    """

    def __init__(self, data: torch.Tensor, seq_len: int) -> None:
        self.data = data
        self.seq_len = seq_len

    def __len__(self) -> int:
        return max(0, (len(self.data) - 1) // self.seq_len)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = self.data[i * self.seq_len : (i + 1) * self.seq_len + 1].long()
        return chunk[:-1], chunk[1:]


class ByteTextDataModule(LightningDataModule):
    """Python standard-library source as bytes, split the same way on every run.

    Each file's last ``val_fraction`` (cut at a line break) goes to validation, the rest to training, so both
    sets see every module's style and no window straddles the split.

    Example::

        dm = ByteTextDataModule(seq_len=64, batch_size=8)
        dm.setup("fit")
        x, y = next(iter(dm.train_dataloader()))   # two (8, 64) int64 tensors of byte values

    Args:
        source: ``"modules"`` reads the modules in ``modules``; ``"stdlib"`` reads the whole standard library.
        modules: standard-library modules for ``source="modules"`` (default: ``DEFAULT_MODULES``).
        seq_len: bytes per training sequence.
        batch_size: sequences per batch.
        val_fraction: share of each file held out for validation.
        max_bytes: cap on the corpus size (bytes, taken from the start); ``None`` keeps everything.
        num_workers: DataLoader worker processes.
    """

    def __init__(
        self,
        source: Literal["modules", "stdlib"] = "modules",
        modules: Optional[list[str]] = None,
        seq_len: int = 128,
        batch_size: int = 32,
        val_fraction: float = 0.05,
        max_bytes: Optional[int] = None,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        if source not in ("modules", "stdlib"):
            raise ValueError(f"source={source!r} is invalid: use 'modules' or 'stdlib'.")
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"val_fraction={val_fraction!r} is invalid: use a number between 0 and 1.")
        if seq_len < 1 or batch_size < 1:
            raise ValueError(f"seq_len={seq_len} and batch_size={batch_size} must be >= 1.")
        self.source = source
        self.modules = tuple(modules) if modules is not None else DEFAULT_MODULES
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.val_fraction = val_fraction
        self.max_bytes = max_bytes
        self.num_workers = num_workers
        self.train_data: Optional[torch.Tensor] = None
        self.val_data: Optional[torch.Tensor] = None

    def setup(self, stage: str) -> None:
        if self.train_data is not None:
            return
        files = stdlib_sources() if self.source == "stdlib" else module_sources(self.modules)
        if not files:
            raise RuntimeError(
                f"No standard-library source found for {self.modules} (this Python ships no .py files?);"
                " try --data.source=stdlib or other --data.modules."
            )
        train, val, total = [], [], 0
        for _, text in files:
            if self.max_bytes is not None and total >= self.max_bytes:
                break
            if self.max_bytes is not None:
                text = text[: self.max_bytes - total]
            total += len(text)
            cut = int(len(text) * (1.0 - self.val_fraction))
            newline = text.find(b"\n", cut)
            cut = newline + 1 if newline >= 0 else cut
            train.append(text[:cut])
            val.append(text[cut:])
        self.train_data = torch.frombuffer(bytearray(b"\n".join(train)), dtype=torch.uint8)
        self.val_data = torch.frombuffer(bytearray(b"\n".join(val)), dtype=torch.uint8)
        if len(self.val_data) <= self.seq_len:
            raise ValueError(
                f"The validation text ({len(self.val_data)} bytes) is shorter than seq_len={self.seq_len}:"
                " raise val_fraction or max_bytes, or lower seq_len."
            )

    def train_dataloader(self) -> DataLoader:
        return DataLoader(
            ByteWindows(self.train_data, self.seq_len), batch_size=self.batch_size, shuffle=True, drop_last=True,
            num_workers=self.num_workers, persistent_workers=self.num_workers > 0,
        )

    def val_dataloader(self) -> DataLoader:
        return DataLoader(
            ByteWindows(self.val_data, self.seq_len), batch_size=self.batch_size, shuffle=False,
            num_workers=self.num_workers, persistent_workers=self.num_workers > 0,
        )


# ----------------------------------------------------------------------------------------------- model
class Attention(nn.Module):
    """Multi-head attention through ``scaled_dot_product_attention`` (flash kernels on GPUs in bf16/fp16).

    Self-attention when ``context`` is ``None`` (causal if ``causal``), cross-attention to ``context`` otherwise.

    Example::

        attn = Attention(64, heads=4, causal=True)
        y = attn(torch.randn(2, 10, 64))                            # (2, 10, 64)
        z = Attention(64, heads=4)(y, context=torch.randn(2, 5, 64))
    """

    def __init__(self, width: int, heads: int, causal: bool = False, dropout: float = 0.0) -> None:
        super().__init__()
        if width % heads:
            raise ValueError(f"width={width} is not divisible by heads={heads}.")
        self.heads, self.causal, self.dropout = heads, causal, dropout
        self.q = nn.Linear(width, width, bias=False)
        self.kv = nn.Linear(width, 2 * width, bias=False)
        self.out = nn.Linear(width, width, bias=False)

    def forward(self, x: torch.Tensor, context: Optional[torch.Tensor] = None) -> torch.Tensor:
        b, t, c = x.shape
        source = x if context is None else context
        q = self.q(x).view(b, t, self.heads, c // self.heads).transpose(1, 2)
        k, v = self.kv(source).view(b, source.shape[1], 2, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=self.causal and context is None
        )
        return self.out(y.transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    """Pre-norm transformer block: self-attention, optional cross-attention, GELU MLP, each residual.

    Example::

        block = Block(64, heads=4, causal=True)
        y = block(torch.randn(2, 10, 64))
    """

    def __init__(self, width: int, heads: int, causal: bool = False, cross: bool = False, dropout: float = 0.0) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(width)
        self.attn = Attention(width, heads, causal=causal, dropout=dropout)
        self.norm_cross = nn.LayerNorm(width) if cross else None
        self.cross = Attention(width, heads, dropout=dropout) if cross else None
        self.norm2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(approximate="tanh"), nn.Linear(4 * width, width), nn.Dropout(dropout)
        )

    def forward(self, x: torch.Tensor, context: Optional[torch.Tensor] = None) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        if self.cross is not None:
            x = x + self.cross(self.norm_cross(x), context)
        return x + self.mlp(self.norm2(x))


def init_weights(module: nn.Module, depth: int) -> None:
    """GPT-2 initialisation: N(0, 0.02), residual output projections scaled by 1/sqrt(2 * depth)."""
    for name, p in module.named_parameters():
        if p.dim() < 2:
            continue
        residual = name.endswith(("attn.out.weight", "cross.out.weight", "mlp.2.weight"))
        std = 0.02 / math.sqrt(2 * depth) if residual else 0.02
        nn.init.normal_(p, mean=0.0, std=std)


def warmup_cosine(step: int, warmup: int, total: int, floor: float) -> float:
    """LR multiplier: linear warm-up over ``warmup`` steps, then cosine decay to ``floor`` at ``total``."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


class GPTMini(LightningModule):
    """A small byte-level GPT: pre-norm blocks, SDPA causal attention, output layer tied to the embedding.

    Example::

        from lightning.pytorch import Trainer
        from lightning_mp import MPPlugin

        trainer = Trainer(plugins=[MPPlugin("bf16")], max_steps=200)
        trainer.fit(GPTMini(), datamodule=ByteTextDataModule())

    Args:
        width: model width (embedding size); a multiple of ``heads`` (and of 16 for fp8).
        depth: number of transformer blocks.
        heads: attention heads.
        context: longest sequence the position table covers (>= ``data.seq_len``).
        dropout: dropout inside the blocks.
        lr: peak learning rate of AdamW.
        weight_decay: AdamW weight decay on matrices (not on norms and biases).
        warmup_steps: linear warm-up steps before the cosine decay.
        min_lr_ratio: final learning rate as a fraction of ``lr``.
        sample_bytes: bytes to generate greedily after ``prompt`` at each validation (0: none).
        prompt: text the validation sample starts from.
    """

    def __init__(
        self,
        width: int = 128,
        depth: int = 4,
        heads: int = 4,
        context: int = 128,
        dropout: float = 0.0,
        lr: float = 3e-3,
        weight_decay: float = 0.1,
        warmup_steps: int = 50,
        min_lr_ratio: float = 0.1,
        sample_bytes: int = 120,
        prompt: str = "    def ",
    ) -> None:
        super().__init__()
        if width % heads:
            raise ValueError(f"width={width} is not divisible by heads={heads}: pick heads that divide width.")
        self.save_hyperparameters()
        self.context = context
        self.embed = nn.Embedding(256, width)
        self.pos = nn.Parameter(torch.zeros(context, width))
        self.blocks = nn.ModuleList(Block(width, heads, causal=True, dropout=dropout) for _ in range(depth))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, 256, bias=False)
        init_weights(self, depth)
        self.head.weight = self.embed.weight  # weight tying, after init so both names share one tensor

    def setup(self, stage: str) -> None:
        data = getattr(self.trainer, "datamodule", None) if self._trainer is not None else None
        seq_len = getattr(data, "seq_len", 0)
        if seq_len > self.context:
            raise ValueError(f"data.seq_len={seq_len} exceeds model.context={self.context}: raise --model.context.")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[1] > self.context:
            raise ValueError(
                f"Sequence length {x.shape[1]} exceeds model.context={self.context}: raise --model.context"
                " to at least --data.seq_len."
            )
        h = self.embed(x) + self.pos[: x.shape[1]]
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))

    def _loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        # logits to fp32 before the softmax: the loss is a large reduction of exponentials (the VLM guide's advice)
        return F.cross_entropy(self(x).float().flatten(0, 1), y.flatten())

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        loss = self._loss(batch)
        self.log("val/loss", loss, prog_bar=True, sync_dist=True)
        self.log("val/bits_per_byte", loss / math.log(2), sync_dist=True)
        if batch_idx == 0 and self.hparams.sample_bytes > 0 and not self.trainer.sanity_checking:
            # generated here, inside the precision plugin's autocast, so the sample shows this precision's model
            text = self.generate(self.hparams.prompt, self.hparams.sample_bytes)
            self.print(f"\n[step {self.global_step}] sample: {text!r}")

    @torch.no_grad()
    def generate(self, prompt: str, length: int) -> str:
        """Greedy continuation of ``prompt`` by ``length`` bytes, decoded as UTF-8 (bad bytes replaced)."""
        x = torch.tensor([list(prompt.encode("utf-8")) or [10]], device=self.device)
        for _ in range(length):
            logits = self(x[:, -self.context :])[:, -1]
            x = torch.cat([x, logits.argmax(-1, keepdim=True)], dim=1)
        return bytes(x[0].tolist()).decode("utf-8", errors="replace")

    def configure_optimizers(self):
        return adamw_warmup_cosine(self)


def adamw_warmup_cosine(module: LightningModule) -> dict:
    """AdamW (no weight decay on biases and norms) with a step-interval warm-up + cosine schedule, from the
    module's ``lr``, ``weight_decay``, ``warmup_steps`` and ``min_lr_ratio`` hyperparameters."""
    hp = module.hparams
    decay = [p for p in module.parameters() if p.dim() >= 2]
    no_decay = [p for p in module.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": hp.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=hp.lr, betas=(0.9, 0.95),
    )
    total = max(1, int(module.trainer.estimated_stepping_batches))
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: warmup_cosine(step, hp.warmup_steps, total, hp.min_lr_ratio)
    )
    return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


def main(args: Optional[list[str]] = None) -> MPLightningCLI:
    """``python -m examples.gpt_mini fit --config examples/configs/gpt_mini_bf16.yaml`` (``args`` for tests)."""
    from lightning_mp.tools.cli import MPLightningCLI  # needs jsonargparse: imported only for the CLI

    return MPLightningCLI(GPTMini, ByteTextDataModule, args=args, save_config_kwargs={"overwrite": True})


if __name__ == "__main__":
    main()
