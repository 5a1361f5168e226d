"""LLMEngine: builds model -> plan -> size -> allocator -> scheduler -> runner, and turns
requests into outputs one step at a time (tokenize, validate, clip, stop, detokenize)."""
