"""The vLLM engine harness the benchmarks and the tests share (neither a benchmark nor a test): a real
engine in a child process driven by JSON commands (`vllm_engine`, `vllm_child`) and the audit of every
page a connector restores (`page_audit`). It sits above the core: `spec`, `store` and `connectors`
never import it."""
