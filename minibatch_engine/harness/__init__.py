"""The measuring harness: what the book and the bench run and measure.

* :mod:`.workload`: named, seeded request mixes;
* :mod:`.metrics`: vLLM's latency, throughput and goodput metrics;
* :mod:`.bench`: one run and its summary; :mod:`.sweep`: one configuration
  over a list of request rates;
* :mod:`.profiling`: where a run's step time goes;
  :mod:`.machine_limit`: this CPU's limit for a model;
* :mod:`.endpoint_client`: the load client for any OpenAI-compatible server;
* :mod:`.vs_transformers`: Hugging Face ``transformers`` run beside the engine.
"""
