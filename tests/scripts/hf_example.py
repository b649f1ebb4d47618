"""A training script written the way the transformers examples are, which hfscale knows nothing about.

Its arguments come from the command line through ``HfArgumentParser`` (its own model and data arguments beside
``TrainingArguments``); its model is its own class (a small Transformer classifier with a custom config, a
``PreTrainedModel`` that hfscale does not build); its data are variable-length token sequences that its own collator
pads per batch. ``hfscale sweep`` runs it unmodified under each trial's strategy (tests/scenarios/test_script.py):

    python hf_example.py --output_dir out --per_device_train_batch_size 8 [--bf16] [--exit_early] [--args_in_code]

``--exit_early`` makes it return before training (a script that never trains must be a failed row);
``--args_in_code`` builds its ``TrainingArguments`` in code instead of from the command line.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

import datasets
import torch
from torch import nn
from transformers import HfArgumentParser, PretrainedConfig, PreTrainedModel, Trainer, TrainingArguments, set_seed
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import SequenceClassifierOutput


@dataclass
class ModelArguments:
    hidden_size: int = field(default=32, metadata={"help": "width of the model"})
    num_layers: int = field(default=2, metadata={"help": "Transformer blocks"})


@dataclass
class DataArguments:
    num_samples: int = field(default=256, metadata={"help": "training sequences"})
    min_len: int = field(default=8, metadata={"help": "shortest sequence"})
    max_len: int = field(default=48, metadata={"help": "longest sequence"})
    exit_early: bool = field(default=False, metadata={"help": "return before training"})
    args_in_code: bool = field(default=False, metadata={"help": "build TrainingArguments in code, not from argv"})


class TinyConfig(PretrainedConfig):
    model_type = "hf_example_tiny"

    def __init__(self, vocab_size: int = 512, hidden_size: int = 32, num_layers: int = 2, **kwargs) -> None:
        self.vocab_size, self.hidden_size, self.num_layers = vocab_size, hidden_size, num_layers
        kwargs.setdefault("num_labels", 2)
        super().__init__(**kwargs)


class TinyBlock(GradientCheckpointingLayer):
    def __init__(self, config: TinyConfig) -> None:
        super().__init__()
        width = config.hidden_size
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(width, width) for _ in range(4))
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = self.norm1(hidden)
        scores = self.q_proj(x) @ self.k_proj(x).transpose(1, 2) / x.shape[-1] ** 0.5
        scores = scores.masked_fill(~mask[:, None, :], torch.finfo(scores.dtype).min)
        hidden = hidden + self.o_proj(scores.softmax(-1) @ self.v_proj(x))
        return hidden + self.mlp(self.norm2(hidden))


class TinyClassifier(PreTrainedModel):
    config_class = TinyConfig
    _no_split_modules = ["TinyBlock"]  # noqa: RUF012 - as transformers' own models declare it
    supports_gradient_checkpointing = True

    def __init__(self, config: TinyConfig) -> None:
        super().__init__(config)
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.blocks = nn.ModuleList(TinyBlock(config) for _ in range(config.num_layers))
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)
        self.post_init()

    def get_input_embeddings(self) -> nn.Module:
        return self.embed

    def forward(self, input_ids, attention_mask=None, labels=None, **kwargs) -> SequenceClassifierOutput:
        mask = attention_mask.bool() if attention_mask is not None else torch.ones_like(input_ids, dtype=torch.bool)
        hidden = self.embed(input_ids)
        for block in self.blocks:
            hidden = block(hidden, mask)
        pooled = (hidden * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
        logits = self.classifier(pooled)
        loss = nn.functional.cross_entropy(logits.float(), labels) if labels is not None else None
        return SequenceClassifierOutput(loss=loss, logits=logits)


def make_data(args: DataArguments, vocab_size: int) -> datasets.Dataset:
    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(args.min_len, args.max_len + 1, (args.num_samples,), generator=generator)
    ids = [torch.randint(1, vocab_size, (int(n),), generator=generator).tolist() for n in lengths]
    labels = [int(row[0] % 2) for row in ids]
    return datasets.Dataset.from_dict({"input_ids": ids, "labels": labels})


def collate(batch: list[dict]) -> dict[str, torch.Tensor]:
    """Pads each batch to its longest sequence (dynamic padding), as the examples' collators do."""
    longest = max(len(item["input_ids"]) for item in batch)
    ids = torch.zeros(len(batch), longest, dtype=torch.long)
    mask = torch.zeros(len(batch), longest, dtype=torch.long)
    for row, item in enumerate(batch):
        ids[row, : len(item["input_ids"])] = torch.tensor(item["input_ids"])
        mask[row, : len(item["input_ids"])] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": torch.tensor([item["labels"] for item in batch])}


def main() -> None:
    parser = HfArgumentParser((ModelArguments, DataArguments, TrainingArguments))
    model_args, data_args, training_args = parser.parse_args_into_dataclasses()
    if data_args.args_in_code:  # as a script that never parses its TrainingArguments does
        training_args = TrainingArguments(output_dir="out", per_device_train_batch_size=8, max_steps=1000, use_cpu=True)
    set_seed(training_args.seed)
    config = TinyConfig(hidden_size=model_args.hidden_size, num_layers=model_args.num_layers)
    model = TinyClassifier(config)
    train_dataset = make_data(data_args, config.vocab_size)
    if data_args.exit_early:
        sys.exit(0)
    trainer = Trainer(model=model, args=training_args, train_dataset=train_dataset, data_collator=collate)
    trainer.train()
    trainer.save_model()  # after training: not part of the measurement


if __name__ == "__main__":
    main()
