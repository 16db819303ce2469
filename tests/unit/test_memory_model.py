"""The memory model reproduces the playbook's numbers and the model's real parameter counts."""

from __future__ import annotations

import pytest

from parallel.job import ModelConfig
from parallel.layout import Layout
from parallel.memory_model import (
    in_flight_microbatches,
    korthikanti_layer_bytes,
    layer_activation_bytes,
    param_counts,
    peak_memory,
    rank_memory,
    state_bytes_per_param,
    zero_state_bytes,
)

pytestmark = pytest.mark.unit

GB = 10**9


@pytest.mark.parametrize(
    ("billions", "without_fp32_grads", "with_fp32_grads"),
    # The playbook's table of model-state memory in mixed precision (GB = 1e9 bytes).
    [(1, 16, 20), (7, 112, 140), (70, 1120, 1400), (405, 6480, 8100)],
)
def test_mixed_precision_state_matches_the_playbook_table(
    billions: int, without_fp32_grads: int, with_fp32_grads: int
) -> None:
    psi = billions * 10**9
    plain = zero_state_bytes(psi, state_bytes_per_param("bf16"), zero=0, dp=1)
    accum = zero_state_bytes(psi, state_bytes_per_param("bf16", fp32_grad_accum=True), 0, 1)
    assert plain.total == without_fp32_grads * GB
    assert accum.total == with_fp32_grads * GB
    assert plain.activations == accum.activations == 0


def test_fp32_training_is_16_bytes_per_parameter_with_or_without_accumulation() -> None:
    for accum in (False, True):
        state = state_bytes_per_param("fp32", accum)
        assert (state.params, state.grads, state.optimizer) == (4, 4, 8)
    with pytest.raises(ValueError, match="mixed_precision"):
        state_bytes_per_param("fp16")


@pytest.mark.parametrize("n", [1, 2, 4, 8, 64])
def test_zero_stages_follow_the_playbook_formulas(n: int) -> None:
    psi = 7 * 10**9  # divisible by every n above: the formulas hold exactly
    state = state_bytes_per_param("bf16")
    expected = {
        0: (2 * psi, 2 * psi, 12 * psi),
        1: (2 * psi, 2 * psi, 12 * psi // n),  # 2Ψ + 2Ψ + 12Ψ/N
        2: (2 * psi, 2 * psi // n, 12 * psi // n),  # 2Ψ + (2 + 12)Ψ/N
        3: (2 * psi // n, 2 * psi // n, 12 * psi // n),  # (2 + 2 + 12)Ψ/N
    }
    for stage, (params, grads, optimizer) in expected.items():
        got = zero_state_bytes(psi, state, stage, n)
        assert (got.params, got.grads, got.optimizer) == (params, grads, optimizer), stage


def test_zero_shards_round_up_to_whole_parameters() -> None:
    got = zero_state_bytes(10, state_bytes_per_param("fp32"), zero=3, dp=4)  # 3 params a shard
    assert (got.params, got.grads, got.optimizer) == (12, 12, 24)
    with pytest.raises(ValueError, match="zero"):
        zero_state_bytes(10, state_bytes_per_param("fp32"), zero=4, dp=1)


@pytest.mark.parametrize(
    "cfg",
    [
        ModelConfig(),
        ModelConfig(tie_word_embeddings=True),
        ModelConfig(hidden_size=96, intermediate_size=200, num_hidden_layers=3,
                    num_attention_heads=6, num_key_value_heads=2, vocab_size=300),
    ],
)
def test_param_counts_match_the_trainer_model(cfg: ModelConfig) -> None:
    torch = pytest.importorskip("torch")
    from models.llama.model import build_model

    with torch.device("meta"):
        model = build_model(cfg)
    assert param_counts(cfg).total == sum(p.numel() for p in model.parameters())


# s = 2048, b = 1, h = 4096, a = 32: sbh = 8_388_608 and 5as/h = 5 * 32 * 2048 / 4096 = 80.
S, B, H, A = 2048, 1, 4096, 32
SBH = 8_388_608


@pytest.mark.parametrize(
    ("tp", "sp", "recompute", "expected"),
    [
        (1, False, "none", SBH * 114),  # sbh(34 + 80)
        (1, False, "selective", SBH * 34),
        (1, False, "full", SBH * 2),
        (4, False, "none", SBH * 36),  # sbh(10 + 24/4 + 80/4)
        (4, False, "selective", SBH * 16),  # sbh(10 + 24/4)
        (4, True, "none", SBH * 57 // 2),  # sbh(34/4 + 80/4) = sbh * 28.5
        (4, True, "selective", SBH * 17 // 2),  # sbh * 34/4
        (4, True, "full", SBH // 2),  # 2sbh/4
        (4, False, "full", SBH * 2),  # without SP each TP rank keeps the whole input
        (1, True, "none", SBH * 114),  # SP means nothing without TP
    ],
)
def test_korthikanti_table_2_by_hand(tp: int, sp: bool, recompute: str, expected: int) -> None:
    assert korthikanti_layer_bytes(S, B, H, A, tp, sp, recompute) == expected


def test_layer_activations_count_what_the_llama_block_saves() -> None:
    # The tensors autograd saves for models/llama/model.py's block (trainer/memory_meter.py counts
    # them; tests/distributed/test_memory_measured.py compares): T tokens, fp32.
    model = ModelConfig(hidden_size=H, intermediate_size=11008, num_hidden_layers=32,
                        num_attention_heads=A, num_key_value_heads=8, max_position_embeddings=S)
    t, h, i, a, d = S * B, H, 11008, A, H // A

    def block(tokens: int, c: int) -> int:
        norms = 2 * (tokens * h * 4 + tokens * 4 + 2 * tokens * h * c)  # fp32 input, rsqrt
        return norms + 4 * tokens * a * d * c + tokens * a * 4 + 4 * tokens * i * c

    assert layer_activation_bytes(model, Layout(mixed_precision="fp32"), S) == block(t, 4)
    # bf16: each layer casts its RoPE rows (cos and sin, for q and k).
    assert layer_activation_bytes(model, Layout(mixed_precision="bf16"), S) == (
        block(t, 2) + 4 * S * d * 2)
    # cp 2: half the tokens, and each layer selects the rows of its global positions.
    assert layer_activation_bytes(model, Layout(cp=2), S) == block(t // 2, 4) + 4 * (S // 2) * d * 4
    assert layer_activation_bytes(model, Layout(), S, recompute="full") == t * h * 4
    # Korthikanti's Table 2 (GPT block, s² scores stored) is the playbook's, much larger.
    assert korthikanti_layer_bytes(S, B, H, A) > layer_activation_bytes(model, Layout(), S)


def _edges(model: ModelConfig, layout: Layout, seq: int) -> int:
    """What a single-stage rank keeps outside its layers (fp32, cp 1, tp 1): the RoPE tables,
    the token ids and targets, the final norm and the log-probabilities."""
    tokens = layout.micro_batch * seq
    rope = 2 * model.max_position_embeddings * model.head_dim * 4
    final_norm = tokens * model.hidden_size * 12 + tokens * 4
    return rope + 2 * tokens * 8 + final_norm + tokens * model.vocab_size * 4 + 4


@pytest.mark.parametrize(("p", "m"), [(2, 8), (4, 8), (4, 16), (8, 32)])
def test_in_flight_microbatches_per_schedule(p: int, m: int) -> None:
    assert in_flight_microbatches("gpipe", p, m) == m
    assert in_flight_microbatches("1f1b", p, m) == p
    assert in_flight_microbatches("1f1b", p, m, pp_rank=p - 1) == 1
    assert in_flight_microbatches("1f1b", p, 1) == 1
    assert in_flight_microbatches("gpipe", 1, m) == in_flight_microbatches("1f1b", 1, m) == 1
    for v in (2, 4):
        # Korthikanti et al.: interleaving costs rank 0 a factor 1 + (p - 1)/(p v) over 1F1B.
        ratio = (in_flight_microbatches("interleaved_1f1b", p, m, v)
                 / in_flight_microbatches("1f1b", p, m))
        assert ratio == pytest.approx(1 + (p - 1) / (p * v))


def test_1f1b_first_stage_keeps_activations_of_all_layers_whatever_pp() -> None:
    # L/p layers times p micro-batches in flight: the first stage holds L layers' worth.
    model = ModelConfig(num_hidden_layers=8)
    per_layer = layer_activation_bytes(model, Layout(), 128)
    # Besides its layers the first stage keeps the RoPE tables and the step's token ids.
    edges = 2 * model.max_position_embeddings * model.head_dim * 4 + 16 * 128 * 8
    for pp in (2, 4, 8):
        layout = Layout(pp=pp, grad_accum=16, pp_schedule="1f1b")
        assert rank_memory(model, layout, 128, pp_rank=0).activations == 8 * per_layer + edges
    gpipe = Layout(pp=4, grad_accum=16, pp_schedule="gpipe")
    assert rank_memory(model, gpipe, 128, pp_rank=0).activations == 2 * 16 * per_layer + edges


def test_rank_memory_splits_state_over_tp_pp_and_dp() -> None:
    model = ModelConfig()  # untied: embedding on the first stage, head on the last
    counts = param_counts(model)
    layers_per_stage = model.num_hidden_layers // 2
    tp = 2
    layer = (counts.per_layer - counts.per_layer_norms) // tp + counts.per_layer_norms
    first = layers_per_stage * layer + counts.embedding // tp
    last = layers_per_stage * layer + counts.head // tp + counts.final_norm
    layout = Layout(dp=2, tp=tp, pp=2, zero=3, grad_accum=4)
    assert rank_memory(model, layout, 128, 0).params == -(-first // 2) * 4
    assert rank_memory(model, layout, 128, 1).params == -(-last // 2) * 4
    peak = peak_memory(model, layout, 128)
    assert peak.total == max(rank_memory(model, layout, 128, r).total for r in (0, 1))


def test_bf16_layouts_accumulate_gradients_in_fp32_by_default() -> None:
    model = ModelConfig()
    psi = param_counts(model).total
    steps = 4 * (9 * model.num_hidden_layers + 3)  # AdamW's fp32 step counter per tensor
    got = rank_memory(model, Layout(zero=1, mixed_precision="bf16"), 128, 0)
    assert (got.params, got.grads, got.optimizer) == (2 * psi, 6 * psi, 12 * psi + steps)
    plain = rank_memory(model, Layout(zero=1, mixed_precision="bf16"), 128, 0,
                        fp32_grad_accum=False)
    assert plain.grads == 2 * psi


def test_full_recompute_and_logits_terms() -> None:
    model = ModelConfig()
    seq = 128
    none = layer_activation_bytes(model, Layout(), seq, recompute="none")
    full = layer_activation_bytes(model, Layout(), seq, recompute="full")
    got = rank_memory(model, Layout(recompute="full"), seq, 0).activations
    assert got == model.num_hidden_layers * full + none + _edges(model, Layout(), seq)


def test_state_is_sharded_tensor_by_tensor_over_dp_times_cp() -> None:
    # h = 96 rows over dp x cp = 2 x 2: chunks of 24; 3 ranks would get 32, 32, 32.
    model = ModelConfig(hidden_size=96, intermediate_size=200, num_hidden_layers=2,
                        num_attention_heads=6, num_key_value_heads=2, vocab_size=300)
    tensors = 9 * 2 + 3
    one = rank_memory(model, Layout(zero=3), 32, 0)
    four = rank_memory(model, Layout(zero=3, dp=2, cp=2), 32, 0)
    assert four.params * 4 == one.params and four.optimizer * 4 == one.optimizer + 3 * tensors * 4
    # 7 ranks: every tensor's dim 0 rounds up (96 -> 14 rows, 200 -> 29, 300 -> 43).
    seven = rank_memory(model, Layout(zero=3, dp=7), 32, 0)
    psi = param_counts(model).total
    assert seven.params > -(-psi // 7) * 4
    # ZeRO-1 and ZeRO-2 keep whole parameters (ZeRO-1) or shards (ZeRO-2 is FSDP2, which
    # shards at rest); ZeRO-1's gradients are whole.
    z1 = rank_memory(model, Layout(zero=1, dp=2), 32, 0)
    z2 = rank_memory(model, Layout(zero=2, dp=2), 32, 0)
    assert z1.params == z1.grads == psi * 4 and z2.params == z2.grads == psi * 2
    assert z1.optimizer == z2.optimizer == psi * 4 + tensors * 4


def test_tp_embedding_gradient_is_whole_under_zero1() -> None:
    model = ModelConfig()
    counts = param_counts(model)
    z1 = rank_memory(model, Layout(zero=1, tp=2), 128, 0)
    assert z1.grads - z1.params == counts.embedding // 2 * 4
