"""VLM-mini: a small vision-language model that learns to caption handwritten digits, under MPPlugin.

The VLM guide's case at toy scale: an image encoder (a small CNN, or a ViT with ``--model.encoder=vit``)
turns an image into a sequence of feature tokens; a transformer text decoder (pre-norm, causal
self-attention and cross-attention to the image tokens, both through ``scaled_dot_product_attention``)
writes the caption one character at a time. The data ships inside scikit-learn: the 1,797 8x8 handwritten
digits of ``sklearn.datasets.load_digits`` (upsampled to 16x16), captioned ``"the digit seven"`` and so on.
Validation generates captions greedily, under the run's precision, and logs ``val/caption_acc`` (exact
caption match) and ``val/digit_acc`` (the digit word right).

CPU (the default size, 0.6 M parameters; the caption accuracy passes 0.9 by step 200 and reaches about 0.98 at
step 600; 43 s on 2 cores of a CPU with native bf16; without native bf16 use the fp32 config, about a minute:
docs/getting-started.md has the times)::

    pip install scikit-learn      # or: pip install -e ".[examples]"
    python -m examples.vlm_mini fit --config examples/configs/vlm_mini_bf16.yaml

GPU (a wider model with a ViT encoder on 32x32 images, to compare the precisions' speed and numerics; the
data set is small, so at this size the model soon knows it by heart)::

    python -m examples.vlm_mini fit --config examples/configs/vlm_mini_bf16.yaml \\
        --model.encoder=vit --model.width=512 --model.depth=6 --model.encoder_depth=6 --model.heads=8 \\
        --model.image_size=32 --model.patch_size=4 --data.image_size=32 --data.batch_size=256 \\
        --trainer.max_steps=2000

Each YAML file under ``examples/configs/`` sets ``trainer.plugins`` to ``lightning_mp.MPPlugin`` with one
precision and adds ``lightning_mp.PrecisionMonitor``; ``--print_config`` shows every argument.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal, Optional

import torch
from lightning.pytorch import LightningDataModule, LightningModule
from torch import nn

if TYPE_CHECKING:
    from lightning_mp.tools.cli import MPLightningCLI
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset

from examples.gpt_mini import Block, adamw_warmup_cosine, init_weights

DIGIT_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
ALPHABET = " abcdefghijklmnopqrstuvwxyz"
PAD, BOS, EOS = 0, 1, 2
VOCAB_SIZE = 3 + len(ALPHABET)


def caption(digit: int) -> str:
    """The caption of a digit: ``caption(7) == "the digit seven"``."""
    return f"the digit {DIGIT_WORDS[digit]}"


#: tokens of the longest caption, with BOS and EOS
MAX_TOKENS = max(len(caption(d)) for d in range(10)) + 2


def encode(text: str) -> list[int]:
    """Character tokens of ``text`` between BOS and EOS: ``encode("a") == [BOS, 4, EOS]``."""
    return [BOS] + [3 + ALPHABET.index(c) for c in text] + [EOS]


def decode(tokens: list[int]) -> str:
    """Text of a token list, up to the first EOS (BOS and PAD dropped)."""
    out = []
    for t in tokens:
        if t == EOS:
            break
        if t >= 3:
            out.append(ALPHABET[t - 3])
    return "".join(out)


# ------------------------------------------------------------------------------------------------ data
class CaptionedDigits(Dataset):
    """``(image (1, S, S) in [0, 1], caption tokens (MAX_TOKENS,), digit)``; random shifts if ``shift > 0``."""

    def __init__(self, images: torch.Tensor, tokens: torch.Tensor, digits: torch.Tensor, shift: int = 0) -> None:
        self.images, self.tokens, self.digits, self.shift = images, tokens, digits, shift

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        image = self.images[i]
        if self.shift:
            s = self.shift
            padded = F.pad(image, (s, s, s, s))
            dy, dx = torch.randint(0, 2 * s + 1, (2,)).tolist()
            image = padded[:, dy : dy + image.shape[1], dx : dx + image.shape[2]]
        return image, self.tokens[i], self.digits[i]


class DigitCaptionDataModule(LightningDataModule):
    """scikit-learn's handwritten digits with captions ("the digit seven"), split the same way on every run.

    Example::

        dm = DigitCaptionDataModule(batch_size=16)
        dm.setup("fit")
        images, tokens, digits = next(iter(dm.train_dataloader()))   # (16, 1, 16, 16), (16, 17), (16,)

    Args:
        image_size: side of the (bilinearly upsampled) square images; 8 keeps the originals.
        batch_size: images per batch.
        val_fraction: share of the 1,797 images held out for validation (a fixed permutation).
        augment: shift training images by up to ``image_size // 8`` pixels.
        num_workers: DataLoader worker processes.
    """

    def __init__(
        self,
        image_size: int = 16,
        batch_size: int = 64,
        val_fraction: float = 0.2,
        augment: bool = True,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        if image_size < 8:
            raise ValueError(f"image_size={image_size} is invalid: use 8 (the originals) or more.")
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"val_fraction={val_fraction!r} is invalid: use a number between 0 and 1.")
        self.image_size = image_size
        self.batch_size = batch_size
        self.val_fraction = val_fraction
        self.augment = augment
        self.num_workers = num_workers
        self.train_set: Optional[CaptionedDigits] = None
        self.val_set: Optional[CaptionedDigits] = None

    def setup(self, stage: str) -> None:
        if self.train_set is not None:
            return
        try:
            from sklearn.datasets import load_digits
        except ImportError as err:
            raise ImportError(
                "vlm_mini reads its images from scikit-learn: pip install scikit-learn (or the 'examples' extra)."
            ) from err
        digits = load_digits()
        images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
        if self.image_size != 8:
            images = F.interpolate(images, size=self.image_size, mode="bilinear", align_corners=False).clamp(0, 1)
        labels = torch.tensor(digits.target, dtype=torch.long)
        tokens = torch.full((len(labels), MAX_TOKENS), PAD, dtype=torch.long)
        for i, d in enumerate(labels.tolist()):
            ids = encode(caption(d))
            tokens[i, : len(ids)] = torch.tensor(ids)
        order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(0))
        n_val = int(len(labels) * self.val_fraction)
        val, train = order[:n_val], order[n_val:]
        shift = self.image_size // 8 if self.augment else 0
        self.train_set = CaptionedDigits(images[train], tokens[train], labels[train], shift=shift)
        self.val_set = CaptionedDigits(images[val], tokens[val], labels[val])

    def train_dataloader(self) -> DataLoader:
        return DataLoader(
            self.train_set, batch_size=self.batch_size, shuffle=True, drop_last=True,
            num_workers=self.num_workers, persistent_workers=self.num_workers > 0,
        )

    def val_dataloader(self) -> DataLoader:
        return DataLoader(
            self.val_set, batch_size=self.batch_size, shuffle=False,
            num_workers=self.num_workers, persistent_workers=self.num_workers > 0,
        )


# ----------------------------------------------------------------------------------------------- model
class CNNEncoder(nn.Module):
    """Three conv layers (two with stride 2): an (S, S) image becomes (S/4)^2 tokens of ``width`` features.

    Example::

        tokens = CNNEncoder(64)(torch.rand(2, 1, 16, 16))   # (2, 16, 64)
    """

    def __init__(self, width: int) -> None:
        super().__init__()
        c1, c2 = max(8, width // 4), max(8, width // 2)
        self.net = nn.Sequential(
            nn.Conv2d(1, c1, 3, padding=1), nn.BatchNorm2d(c1), nn.GELU(),
            nn.Conv2d(c1, c2, 3, stride=2, padding=1), nn.BatchNorm2d(c2), nn.GELU(),
            nn.Conv2d(c2, width, 3, stride=2, padding=1), nn.BatchNorm2d(width), nn.GELU(),
        )

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.net(images).flatten(2).transpose(1, 2)


class ViTEncoder(nn.Module):
    """Patch embedding plus ``depth`` pre-norm transformer blocks (bidirectional attention).

    Example::

        tokens = ViTEncoder(64, depth=2, heads=4, patch_size=4)(torch.rand(2, 1, 16, 16))   # (2, 16, 64)
    """

    def __init__(self, width: int, depth: int, heads: int, patch_size: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.patch = nn.Conv2d(1, width, patch_size, stride=patch_size)
        self.blocks = nn.ModuleList(Block(width, heads, dropout=dropout) for _ in range(depth))

    def forward(self, images: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        x = self.patch(images).flatten(2).transpose(1, 2) + pos
        for block in self.blocks:
            x = block(x)
        return x


class VLMMini(LightningModule):
    """Image encoder (CNN or ViT) + transformer caption decoder cross-attending to the image tokens.

    Example::

        from lightning.pytorch import Trainer
        from lightning_mp import MPPlugin

        trainer = Trainer(plugins=[MPPlugin("bf16")], max_steps=300)
        trainer.fit(VLMMini(), datamodule=DigitCaptionDataModule())

    Args:
        encoder: ``"cnn"`` (three conv layers) or ``"vit"`` (patches + transformer blocks).
        width: feature width of encoder and decoder; a multiple of ``heads`` (and of 16 for fp8).
        depth: decoder blocks.
        heads: attention heads.
        encoder_depth: transformer blocks of the ViT encoder (unused by the CNN).
        image_size: image side, as ``data.image_size``; a multiple of 4 (CNN) or of ``patch_size`` (ViT).
        patch_size: ViT patch side.
        dropout: dropout inside the blocks.
        lr: peak learning rate of AdamW.
        weight_decay: AdamW weight decay on matrices.
        warmup_steps: linear warm-up steps before the cosine decay.
        min_lr_ratio: final learning rate as a fraction of ``lr``.
        show_captions: generated captions printed at each validation (0: none).
    """

    def __init__(
        self,
        encoder: Literal["cnn", "vit"] = "cnn",
        width: int = 128,
        depth: int = 2,
        heads: int = 4,
        encoder_depth: int = 2,
        image_size: int = 16,
        patch_size: int = 4,
        dropout: float = 0.0,
        lr: float = 2e-3,
        weight_decay: float = 0.05,
        warmup_steps: int = 50,
        min_lr_ratio: float = 0.1,
        show_captions: int = 3,
    ) -> None:
        super().__init__()
        if encoder not in ("cnn", "vit"):
            raise ValueError(f"encoder={encoder!r} is invalid: use 'cnn' or 'vit'.")
        if width % heads:
            raise ValueError(f"width={width} is not divisible by heads={heads}: pick heads that divide width.")
        stride = 4 if encoder == "cnn" else patch_size
        if image_size % stride:
            raise ValueError(f"image_size={image_size} is not a multiple of {stride} (the {encoder} encoder's stride).")
        self.save_hyperparameters()
        n_image_tokens = (image_size // stride) ** 2
        self.image_pos = nn.Parameter(torch.zeros(n_image_tokens, width))
        if encoder == "cnn":
            self.encoder: nn.Module = CNNEncoder(width)
        else:
            self.encoder = ViTEncoder(width, encoder_depth, heads, patch_size, dropout)
        self.encoder_norm = nn.LayerNorm(width)
        self.embed = nn.Embedding(VOCAB_SIZE, width)
        self.text_pos = nn.Parameter(torch.zeros(MAX_TOKENS, width))
        self.blocks = nn.ModuleList(Block(width, heads, causal=True, cross=True, dropout=dropout) for _ in range(depth))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, VOCAB_SIZE, bias=False)
        init_weights(self, depth)
        self.head.weight = self.embed.weight

    def setup(self, stage: str) -> None:
        data = getattr(self.trainer, "datamodule", None) if self._trainer is not None else None
        size = getattr(data, "image_size", self.hparams.image_size)
        if size != self.hparams.image_size:
            raise ValueError(
                f"data.image_size={size} but model.image_size={self.hparams.image_size}: set both to the same value."
            )

    def encode_images(self, images: torch.Tensor) -> torch.Tensor:
        if self.hparams.encoder == "vit":
            return self.encoder_norm(self.encoder(images, self.image_pos))
        return self.encoder_norm(self.encoder(images) + self.image_pos)

    def decode_tokens(self, tokens: torch.Tensor, image_tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens) + self.text_pos[: tokens.shape[1]]
        for block in self.blocks:
            h = block(h, context=image_tokens)
        return self.head(self.norm(h))

    def forward(self, images: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        return self.decode_tokens(tokens, self.encode_images(images))

    def _loss(self, batch: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> torch.Tensor:
        images, tokens, _ = batch
        logits = self(images, tokens[:, :-1])
        # the loss in fp32 (VLM guide: softmax/log of low-precision logits loses accuracy)
        return F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten(), ignore_index=PAD)

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx: int) -> None:
        images, tokens, digits = batch
        self.log("val/loss", self._loss(batch), prog_bar=True, sync_dist=True)
        # greedy captions, generated inside the precision plugin's autocast: what this precision's model says
        predicted = [decode(t) for t in self.generate(images).tolist()]
        truth = [caption(d) for d in digits.tolist()]
        n = len(truth)
        caption_acc = sum(p == t for p, t in zip(predicted, truth)) / n
        digit_acc = sum(p.split(" ")[-1] == t.split(" ")[-1] for p, t in zip(predicted, truth)) / n
        self.log("val/caption_acc", caption_acc, prog_bar=True, sync_dist=True, batch_size=n)
        self.log("val/digit_acc", digit_acc, sync_dist=True, batch_size=n)
        if batch_idx == 0 and self.hparams.show_captions and not self.trainer.sanity_checking:
            shown = ", ".join(f"{t!r} -> {p!r}" for p, t in list(zip(predicted, truth))[: self.hparams.show_captions])
            self.print(f"\n[step {self.global_step}] {shown}")

    @torch.no_grad()
    def generate(self, images: torch.Tensor) -> torch.Tensor:
        """Greedy caption tokens ``(B, MAX_TOKENS)`` for a batch of images (each starts with BOS)."""
        image_tokens = self.encode_images(images)
        tokens = torch.full((images.shape[0], 1), BOS, dtype=torch.long, device=images.device)
        for _ in range(MAX_TOKENS - 1):
            logits = self.decode_tokens(tokens, image_tokens)[:, -1]
            tokens = torch.cat([tokens, logits.argmax(-1, keepdim=True)], dim=1)
        return tokens

    def configure_optimizers(self):
        return adamw_warmup_cosine(self)


def main(args: Optional[list[str]] = None) -> MPLightningCLI:
    """``python -m examples.vlm_mini fit --config examples/configs/vlm_mini_bf16.yaml`` (``args`` for tests)."""
    from lightning_mp.tools.cli import MPLightningCLI  # needs jsonargparse: imported only for the CLI

    return MPLightningCLI(VLMMini, DigitCaptionDataModule, args=args, save_config_kwargs={"overwrite": True})


if __name__ == "__main__":
    main()
