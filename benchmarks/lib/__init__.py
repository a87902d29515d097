"""What only the benchmarks use: A B B A rounds, the headline ratio tables, the raw-decode and
`vllm bench serve` measurements, the vLLM venv they run in, and the fidelity page.  The package
never imports it."""
