"""What chooses each token.

* :mod:`.params`: ``SamplingParams``, shaped like vLLM's;
* :mod:`.sampler`: the batched sampler (temperature, top-k, top-p, seeded draws);
* :mod:`.logits_process`: vLLM's logits processors (penalties, ``min_p``, bad words);
* :mod:`.logprobs`: log-probabilities from the raw distribution;
* :mod:`.structured_output`: grammars as per-row token masks (xgrammar).
"""
