"""The HTTP front door: FastAPI routes (OpenAI, native, control) over the tokenizer's front door."""
