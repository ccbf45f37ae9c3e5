"""GGUF files as models: read as they ship (`file`), their tensors kept quantized where a kernel serves
them (`weights`), loaded tensor by tensor (`loader`)."""
