"""Other formats in and out: Hugging Face safetensors, PyTorch DCP, and the
tensor-at-a-time streaming both conversions are built on."""
