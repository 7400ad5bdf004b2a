"""`skiff bench`: a serving benchmark against any OpenAI-compatible URL (Skiff or another server).

Streams requests at a chosen concurrency and arrival rate and reports time to first token, time
per output token, inter-token latency, end-to-end latency and throughput, like `vllm bench
serve`. The client side only: nothing here imports torch, triton or model code.

- options.py: the command's flags and the typed BenchConfig built from them
- workload.py: the prompts (random words or a dataset file) and the arrival schedule
- client.py: one streamed request, timed chunk by chunk
- run.py: the request loop (rate, concurrency, progress) and the command's entry point
- report.py: percentiles, the summary, the printed table and the JSON file
- progress.py: the progress bar on stderr
"""
