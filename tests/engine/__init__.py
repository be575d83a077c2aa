"""Engine tests: the offline LLM and LLMEngine on the tiny models, the engine core process, detokenizing, defaults."""
