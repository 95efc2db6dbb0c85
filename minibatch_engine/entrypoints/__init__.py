"""The ways in besides ``LLM`` (which stays at the package root).

* :mod:`.async_llm`: ``AsyncLLM``, online and streaming;
* :mod:`.cli`: the ``minibatch-engine`` command (``python -m minibatch_engine``);
* :mod:`.server`: OpenAI's HTTP API (``serve``) and the router in front of
  several servers (``route``).
"""
