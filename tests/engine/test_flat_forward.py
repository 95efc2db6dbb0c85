"""The forward as a flat loop of CPU kernel calls (runner/flat_forward.py):
bit-identical logits and tokens, and the model's own forward wherever a piece
has no kernel."""
import pytest
import torch

from minibatch_engine import Engine, SamplingParams, build_model
from minibatch_engine.attention.cpu_kernel import cpu_kernel_or_none
from minibatch_engine.model import fused
from minibatch_engine.model.config import get_preset
from minibatch_engine.runner.flat_forward import FlatForward
from minibatch_engine.runner.prepack import prepack_linear_weights, unpack_linear_weights

pytestmark = pytest.mark.skipif(cpu_kernel_or_none() is None, reason="the C++ CPU kernels do not build here")

PROMPTS = [list(range(3 + i, 30 + 7 * i)) for i in range(5)]


def run(model, flat: bool, **config):
    eng = Engine(model, max_num_seqs=4, **config)
    if not flat:
        eng.runner.flat = None
    reqs = [eng.add_request(p, SamplingParams(max_tokens=24, ignore_eos=True)) for p in PROMPTS]
    eng.run()
    return [r.output_token_ids for r in reqs], eng


@pytest.mark.parametrize("loop", ["cpp", "python", "wrapped"])
def test_logits_are_bit_identical_to_the_models_forward(loop):
    """Every loop: the decoder layers as one C++ call, the Python loop
    (``use_cpp=False``), and the Python loop taken because the backend's
    forward is wrapped, as the profiling harness wraps it."""
    model = build_model("tiny", device="cpu")
    eng = Engine(model, max_num_seqs=4)
    runner, checked = eng.runner, []
    flat = runner.flat
    if loop == "python":
        flat.use_cpp = False
    if loop == "wrapped":
        runner.attention.forward = runner.attention.forward     # an instance attribute, as a wrapper is

    class Checking:            # the runner's flat forward, each step compared with the model's
        def __init__(self, flat):
            self.flat = flat

        def can_run(self, num_tokens, meta):
            return self.flat.can_run(num_tokens, meta)

        def __call__(self, input_ids, positions, meta):
            kv = runner.kv_pool.kv
            before = kv.clone()                # both write the step's K/V: compare from one state
            flat = self.flat(input_ids, positions, meta)
            after, _ = kv.clone(), kv.copy_(before)
            ref = model(input_ids, positions, meta, runner.kv_pool)
            assert torch.equal(flat, ref) and torch.equal(kv, after)
            checked.append(input_ids.shape[0])
            return flat
    runner.flat = Checking(runner.flat)
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    for p in PROMPTS[:2]:
        eng.add_request(p, params)
    eng.step()                                     # the prompts (packing the weights: not flat)
    eng.step()
    for p in PROMPTS[2:4]:                         # prompts joining decodes: a mixed step
        eng.add_request(p, params)
    eng.run()
    assert len(checked) >= 25 and max(checked) > 4
    assert flat.steps == len(checked) and flat.cpp_steps == (len(checked) if loop == "cpp" else 0)


def test_tokens_equal_and_decode_steps_run_flat():
    model = build_model("tiny", device="cpu")
    with_flat, eng = run(model, True)
    without, _ = run(model, False)
    assert with_flat == without
    # every step but the first, which packs the weights through the model's forward
    assert eng.runner.flat.steps == len(eng.trace.steps) - 1 > 0


def test_the_models_forward_where_a_piece_has_no_kernel():
    model = build_model("tiny", device="cpu")
    tokens, eng = run(model, True, attention_backend="sdpa")
    assert eng.runner.flat.steps == 0
    _, eng = run(model, True, kv_cache_dtype="int8")
    assert not eng.runner.flat.supported and eng.runner.flat.steps == 0
    _, eng = run(build_model(get_preset("tiny").with_(qk_norm=True, name="tiny-qk"), device="cpu"), True)
    assert eng.runner.flat is not None and not eng.runner.flat.supported
    _, eng = run(build_model("tiny", device="cpu", dtype="float64"), True)
    assert not eng.runner.flat.supported
    with fused.torch_ops_only():
        _, eng = run(model, True)
    assert eng.runner.flat.steps == 0
    handle = model.layers[0].mlp.register_forward_hook(lambda *a: None)   # a hook must see its calls
    try:
        _, eng = run(model, True)
        assert eng.runner.flat.steps == 0
    finally:
        handle.remove()


def test_weights_unpacked_or_changed_are_followed():
    model = build_model("tiny", device="cpu")
    eng = Engine(model, max_num_seqs=4)
    flat = eng.runner.flat
    eng.add_request(PROMPTS[0], SamplingParams(max_tokens=8, ignore_eos=True))
    eng.step()
    eng.step()
    assert flat.layers is not None
    unpack_linear_weights(model)                  # plain weights: the model's forward
    before = flat.steps
    eng.step()
    assert flat.steps == before and flat.layers is None
    prepack_linear_weights(model, only_where_faster=False)
    eng.step()                                    # packs lazily, through the model's forward
    eng.step()
    assert flat.steps == before + 1
    with torch.no_grad():
        model.layers[1].mlp.down_proj.weight.mul_(0.5)    # changed in place: repacked, then flat again
    eng.step()
    eng.step()
    assert flat.steps == before + 2
    assert isinstance(flat, FlatForward)
