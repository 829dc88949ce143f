"""Where prompts come from: generated toy tasks, JSONL files with a saveable cursor, and the tokenizers."""
