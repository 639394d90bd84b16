"""The phases of `scripts/train_default_pair.py`: data and tokenizer, models, training,
evaluation, model card. The script imports this package from its own folder."""
