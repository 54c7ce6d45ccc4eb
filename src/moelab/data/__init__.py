"""Data: sources -> tokenizer -> token store -> phased mixture -> batches."""
