"""Commands around the library, never imported by it: vLLM's command line on every build (`vllm_cli`)."""
