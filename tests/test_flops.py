"""
GPT.estimate_flops() against an independent count of the FLOPs a forward + backward actually runs.

What the formula counts, per token of a training step (forward + backward = 3x the forward):
- 6 * N for the matmuls, N = every parameter except the token embedding (the blocks' c_q, c_k, c_v, c_proj, c_fc,
  c_proj and the lm_head): 2 FLOPs per multiply-add in the forward, twice that in the backward (input and weight
  gradients);
- 12 * n_layer * n_head * head_dim * T for attention (T = max_seq_len): Q K^T and A V each cost 2 * T * head_dim per
  token and head in the forward, counted over the full T x T (causal masking is not subtracted, as in PaLM appendix B
  and nanochat), times 3 for the backward;
- the embedding lookup is free (a gather, and its backward a scatter-add); norms, rotary, softmax, soft-cap and
  the cross-entropy are elementwise and not counted.
torch.utils.flop_counter.FlopCounterMode counts exactly the matmuls (mm/bmm) of the traced step. On CPU, SDPA's
fused kernel has no FLOP formula, so attention runs on SDPA's math backend here, which performs it as bmm's.
"""

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from nanotrain.gpt import GPT, GPTConfig, config_from_depth

pytestmark = pytest.mark.unit


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny matmuls run fastest on one thread (and OpenMP spinning on a busy 2-core machine costs 50x here)."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)

CONFIGS = {
    "depth2": config_from_depth(2, 1024, 32),
    "gqa": GPTConfig(max_seq_len=48, vocab_size=500, n_layer=3, n_head=4, n_kv_head=2, model_dim=64),
}


def counted_flops(model, batch_size):
    """FLOPs of one forward + backward of the mean loss on random tokens, (batch_size, max_seq_len), by
    FlopCounterMode with attention on SDPA's math backend."""
    T, V = model.config.max_seq_len, model.config.vocab_size
    x = torch.randint(0, V, (batch_size, T))
    y = torch.randint(0, V, (batch_size, T))
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(x, y).backward()
    return counter.get_total_flops(), counter.get_flop_counts()["Global"]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_estimate_flops_matches_flop_counter(name):
    """
    estimate_flops() * tokens is within 5% of the counted FLOPs (it is exact for these models). Catches: counting the
    embedding as a matmul (6 * all params: 12% to 25% more here), leaving out the lm_head, counting attention with
    n_kv_head instead of n_head under GQA, dropping the attention term, or using 2N (forward only) instead of 6N.
    """
    torch.manual_seed(0)
    model = GPT(CONFIGS[name])
    model.init_weights()
    batch_size = 3
    counted, by_op = counted_flops(model, batch_size)
    estimated = model.estimate_flops() * batch_size * model.config.max_seq_len
    assert abs(estimated - counted) / counted < 0.05, (estimated, counted, by_op)
    wrong = 6 * model.num_params() * batch_size * model.config.max_seq_len  # embedding counted: must be caught
    assert abs(wrong - counted) / counted > 0.05


def test_attention_term_grows_with_sequence_length():
    """
    The attention FLOPs per token grow linearly with T: the counted bmm FLOPs per token at 2T are twice those at T,
    and equal the hand count for depth 2 (1 head of 128): Q K^T and A V cost 2 * T * 128 each per token in the
    forward, x3 with the backward, x2 layers: 3072 * T, i.e. 49,152 at T=16 and 98,304 at T=32. Catches an attention
    term that ignores T or counts T^2 per token; the same literals pin estimate_flops()'s attention term.
    """
    for T, want in ((16, 49_152), (32, 98_304)):
        torch.manual_seed(0)
        model = GPT(config_from_depth(2, 300, T, value_embeds=False, smear=False))  # (the gates' matmuls add 6 x 12 each)
        model.init_weights()
        _, by_op = counted_flops(model, 2)
        bmm = sum(v for k, v in by_op.items() if "bmm" in str(k))
        assert bmm / (2 * T) == want
        assert model.estimate_flops() - 6 * 393_216 - 6 * 38_400 == want  # 6 x (blocks + lm_head weights) + attention


def test_sliding_windows_count_min_window_T_keys_per_layer():
    """
    With sliding windows the attention term counts min(window, T) keys on each windowed layer and T on the full ones,
    as nanochat's estimate_flops does. Depth 4 (2 heads of 128), T = 256: a full layer's term is 12 * 2 * 128 * 256 =
    786,432 per token and a layer with window 64 has 196,608; SSSL (the last layer always full) is 3 * 196,608 +
    786,432 = 1,376,256 against 4 * 786,432 = 3,145,728 for L, so the estimate drops by 1,769,472; a window of 300
    (past T) counts T: no drop. The matmul term does not move. Catches windows ignored, the window counted as W + 1
    keys (1,769,472 - 3 * 3,072 = 1,760,256), the last layer windowed too (2,359,296) and min() left out (W = 300 would
    add FLOPs).
    """
    def flops(**window):
        with torch.device("meta"):
            return GPT(config_from_depth(4, 300, 256, **window)).estimate_flops()
    full = flops()
    assert full - flops(window_pattern="SSSL", short_window=64) == 1_769_472
    assert flops(window_pattern="SSSL", short_window=300) == full == flops(window_pattern="S", short_window=256)
