"""The step loop (LLMEngine) and the offline API (LLM) on top of it."""
