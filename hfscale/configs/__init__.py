"""Strategy -> what the real tools consume: accelerate config YAML, DeepSpeed JSON, FSDP, TrainingArguments."""
