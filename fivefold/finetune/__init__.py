"""Fine-tuning: supervised fine-tuning data (sft) and low-rank adapters (lora), applied from outside the model."""
