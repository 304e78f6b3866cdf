"""What runs around the library, never imported by it (`import kvoffload` and the vLLM plugin load none of
it): the proof (`verify`) and the demo on the bundled GLM runner, the benchmarks (`bench`), the vLLM
engine harness they drive (`harness`), and vLLM's command line on every build (`vllm_cli`)."""
