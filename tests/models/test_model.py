"""The reference model equals transformers.LlamaForCausalLM with the same weights."""

import math

import pytest
import torch

from helpers import logits_of, tiny_model
from tieredkv.models.config import RopeScaling

transformers = pytest.importorskip("transformers")
from tieredkv.models.hf_compat import to_transformers  # noqa: E402

VARIANTS = {
    "gqa": {},
    "mha": {"num_kv_heads": 4},
    "mqa-tied": {"num_kv_heads": 1, "tie_word_embeddings": True},
    "llama3-scaling": {"rope_theta": 500000.0, "rope_scaling": RopeScaling("llama3", 8.0, 1.0, 4.0, 64)},
    "linear-scaling": {"rope_scaling": RopeScaling("linear", 4.0)},
    "odd-dims": {"hidden_size": 72, "num_heads": 6, "num_kv_heads": 3, "head_dim": 12, "intermediate_size": 100},
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_logits_equal_transformers(variant):
    model = tiny_model(seed=3, **VARIANTS[variant])
    tokens = torch.randint(0, model.config.vocab_size, (1, 301), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = to_transformers(model)(tokens).logits[0]
    ours = logits_of(model, tokens[0], chunk=64)
    assert (ref - ours).abs().max().item() <= 1e-4


def test_chunked_prefill_equals_one_shot():
    model = tiny_model(seed=1)
    tokens = torch.randint(0, 512, (257,), generator=torch.Generator().manual_seed(1))
    one = logits_of(model, tokens, chunk=1000)
    for chunk in (1, 7, 64):
        assert (logits_of(model, tokens, chunk=chunk) - one).abs().max().item() <= 1e-5


@pytest.mark.slow
def test_smollm2_equals_transformers(smollm):
    ids = smollm.tokenizer.encode("The history of the city goes back more than two thousand years. It was founded "
                                  "as a small trading post on the banks of the river.")
    tokens = torch.tensor(ids)
    with torch.no_grad():
        ref = to_transformers(smollm.model)(tokens[None]).logits[0]
    assert (ref - logits_of(smollm.model, tokens)).abs().max().item() <= 1e-4


@pytest.mark.slow
def test_smollm2_plain_paragraph_perplexity(smollm):
    from tieredkv.runtime.eval.data import PLAIN_PARAGRAPH

    ids = torch.tensor(smollm.tokenizer.encode(PLAIN_PARAGRAPH))
    logits = logits_of(smollm.model, ids)
    ppl = math.exp(torch.nn.functional.cross_entropy(logits[:-1], ids[1:]).item())
    # the reference figure for SmolLM2-135M on plain English without BOS is about 10.3
    assert 8.0 < ppl < 13.0, ppl
