"""The moe family on one process: routing, the balancing loss, the dispatch permutation, the
MoE layer against a per-token loop, config checks and parameter counts (docs/moe.md)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from models import get_spec
from models.moe import dispatch
from models.moe.config import moe_layers
from models.moe.formulas import moe_counts
from models.moe.router import expert_counts, load_balancing_loss, route
from parallel.context_parallel import zigzag_positions
from parallel.cost_model import Hardware, step_cost
from parallel.expert_parallel import regroup_order
from parallel.job import ConfigError, ModelConfig, load, loads
from parallel.layout import Layout, resolve
from parallel.layout_search import SearchSpace, World, search_layout
from parallel.memory_model import rank_memory
from parallel.planner import NodeInfo, PlanError, plan_generation
from tests.conftest import REPO

pytestmark = pytest.mark.unit

MOE = ModelConfig(family="moe", hidden_size=16, intermediate_size=24, num_hidden_layers=4,
                  num_attention_heads=2, num_key_value_heads=1, vocab_size=32,
                  max_position_embeddings=16, num_experts=4, num_experts_per_tok=2,
                  moe_intermediate_size=8)


def test_route_takes_the_top_k_of_the_softmax_and_renormalises():
    logits = torch.tensor([[2.0, 0.0, 1.0, -1.0], [0.0, 3.0, 0.0, 2.5]])
    probs = F.softmax(logits, dim=-1)
    r = route(logits, 2, normalise=True)
    assert r.experts.tolist() == [[0, 2], [1, 3]]
    top = probs.gather(1, r.experts)
    torch.testing.assert_close(r.weights, top / top.sum(-1, keepdim=True))
    torch.testing.assert_close(r.weights.sum(-1), torch.ones(2))
    raw = route(logits, 2, normalise=False)
    torch.testing.assert_close(raw.weights, top)
    torch.testing.assert_close(r.probs, probs)


def test_route_depends_on_the_token_only():
    logits = torch.randn(6, 5, generator=torch.Generator().manual_seed(0))
    whole = route(logits, 2, True)
    for i in range(6):
        one = route(logits[i:i + 1], 2, True)
        assert torch.equal(one.experts[0], whole.experts[i])
        assert torch.equal(one.weights[0], whole.weights[i])


def test_balancing_loss_by_hand():
    # E = 2, top-1: both tokens pick expert 0, so f = (1, 0); P = mean probs = (0.65, 0.35).
    probs = torch.tensor([[[0.7, 0.3], [0.6, 0.4]]])
    experts = torch.tensor([[[0], [0]]])
    torch.testing.assert_close(load_balancing_loss(probs, experts), torch.tensor([2 * 0.65]))
    # E = 3, top-2, one token: f = (1/2, 1/2, 0), P = (0.5, 0.3, 0.2): 3 (0.25 + 0.15) = 1.2.
    probs = torch.tensor([[[0.5, 0.3, 0.2]]])
    experts = torch.tensor([[[0, 1]]])
    torch.testing.assert_close(load_balancing_loss(probs, experts), torch.tensor([1.2]))
    # Perfect balance gives 1, per sequence (two sequences, each balanced on its own).
    probs = torch.full((2, 4, 4), 0.25)
    experts = torch.tensor([[[0], [1], [2], [3]], [[3], [2], [1], [0]]])
    torch.testing.assert_close(load_balancing_loss(probs, experts), torch.ones(2))


def test_balancing_loss_of_sequence_shares_adds_up():
    """Context parallelism: the cp ranks' shares (each its own tokens' P with the whole
    sequences' counts) add up to the whole sequences' loss, and so do their gradients."""
    logits = torch.randn(2, 8, 4, generator=torch.Generator().manual_seed(5))
    probs = logits.softmax(-1).requires_grad_()
    experts = route(logits, 2, True).experts
    whole = load_balancing_loss(probs, experts)
    (grad_whole,) = torch.autograd.grad(whole.sum(), probs)
    counts = expert_counts(experts, 4)
    shares = [zigzag_positions(8, 2, rank) for rank in range(2)]
    parts = [load_balancing_loss(probs[:, pos], experts[:, pos], counts, 8) for pos in shares]
    torch.testing.assert_close(parts[0] + parts[1], whole)
    (grad_parts,) = torch.autograd.grad(parts[0].sum() + parts[1].sum(), probs)
    torch.testing.assert_close(grad_parts, grad_whole)
    # A share's own counts would not do: the whole sequences' f is needed.
    alone = [load_balancing_loss(probs[:, pos], experts[:, pos]) / 2 for pos in shares]
    assert not torch.allclose(alone[0] + alone[1], whole)


def test_dispatch_groups_copies_by_expert_and_combines_back():
    experts = torch.tensor([[2, 0], [0, 1], [2, 1]])  # 3 tokens, top-2 of 3 experts
    p = dispatch.plan(experts, 3)
    assert p.counts.tolist() == [2, 2, 2]
    tokens = torch.tensor([[10.0], [20.0], [30.0]])
    rows = dispatch.permute(tokens, p)
    # Expert 0: tokens 0 and 1; expert 1: tokens 1 and 2; expert 2: tokens 0 and 2 (stable).
    assert rows.squeeze(1).tolist() == [10.0, 20.0, 20.0, 30.0, 10.0, 30.0]
    weights = torch.tensor([[0.25, 0.75], [0.5, 0.5], [1.0, 2.0]])
    out = dispatch.combine(rows * 2, p, weights)  # every "expert" doubles its input
    torch.testing.assert_close(out, tokens * 2 * weights.sum(-1, keepdim=True))


def test_regroup_order_turns_source_major_blocks_expert_major():
    # 2 sources x 2 local experts: rows [s0e0 s0e0 | s0e1 | s1e0 | s1e1 s1e1 s1e1]
    counts = torch.tensor([[2, 1], [1, 3]])
    assert regroup_order(counts).tolist() == [0, 1, 3, 2, 4, 5, 6]
    assert regroup_order(torch.zeros(2, 2, dtype=torch.int64)).tolist() == []


def _built(cfg: ModelConfig, seed: int = 3) -> torch.nn.Module:
    spec = get_spec("moe")
    model = spec.build(cfg)
    model.to_empty(device="cpu")
    spec.init_weights(model, seed)
    return model


@pytest.mark.parametrize("shared", [0, 2])
def test_moe_layer_equals_a_loop_over_tokens(shared):
    cfg = dataclasses.replace(MOE, num_shared_experts=shared)
    model = _built(cfg)
    moe = model.layers["0"].mlp
    x = torch.randn(2, 5, cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    out = moe(x)
    e = moe.experts
    flat = x.reshape(-1, cfg.hidden_size)
    expected = []
    for tok in flat:
        probs = F.softmax(moe.gate(tok), dim=-1)
        w, idx = probs.topk(2)
        w = w / w.sum()
        y = sum(wj * F.linear(F.silu(F.linear(tok, e.gate_proj[j])) * F.linear(tok, e.up_proj[j]),
                              e.down_proj[j]) for wj, j in zip(w, idx.tolist(), strict=True))
        if shared:
            y = y + moe.shared_experts(tok)
        expected.append(y)
    torch.testing.assert_close(out.reshape(-1, cfg.hidden_size), torch.stack(expected),
                               rtol=1e-5, atol=1e-6)


def test_every_expert_gets_a_gradient_even_without_tokens():
    model = _built(MOE)
    moe = model.layers["0"].mlp
    with torch.no_grad():
        moe.gate.weight.zero_()
        moe.gate.weight[0] = 10.0  # expert 0 and one other win every token
    moe(torch.ones(1, 3, MOE.hidden_size)).sum().backward()
    assert moe.experts.gate_proj.grad is not None
    assert moe.experts.gate_proj.grad[0].abs().sum() > 0


def test_aux_loss_is_counted_in_training_only_and_weighted_per_sequence():
    model = _built(MOE)
    tokens = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(2))
    model(tokens)
    assert model.router_aux.end() == 0  # no begin: evaluation
    model.router_aux.begin(torch.tensor([1.0, 0.0]))
    model(tokens).sum().backward()
    first_only = model.router_aux.end()
    model.router_aux.begin(torch.tensor([0.0, 1.0]))
    model(tokens)
    second_only = model.router_aux.end()
    model.router_aux.begin(torch.tensor([1.0, 1.0]))
    model(tokens)
    torch.testing.assert_close(model.router_aux.end(), first_only + second_only)
    assert first_only > 0 and moe_layers(MOE) == [0, 1, 2, 3]
    # Expert load: the counted rows' copies per expert of each layer, over the whole step
    # (three forwards of 1, 1 and 2 counted sequences of 8 tokens, top-2).
    loads = model.router_aux.take_loads()
    assert sorted(loads) == [0, 1, 2, 3]
    assert all(int(load.sum()) == (1 + 1 + 2) * 8 * 2 for load in loads.values())
    assert model.router_aux.take_loads() == {}
    # The loss's gradient reaches the router.
    assert model.layers["0"].mlp.gate.weight.grad.abs().sum() > 0


def test_one_begin_for_a_pipeline_step_equals_one_per_micro_batch():
    """Under pp the trainer opens the whole step and the pipeline selects each micro-batch
    before its forward: the total is that of opening each micro-batch on its own, and a forward
    before any selection (torch's shape inference) adds nothing."""
    model = _built(MOE)
    batches = torch.randint(0, 32, (3, 2, 8), generator=torch.Generator().manual_seed(5))
    weights = torch.tensor([1.0, 0.5, 0.25, 2.0, 0.0, 1.0])
    per_micro_batch = torch.zeros(())
    for m in range(3):
        model.router_aux.begin(weights[2 * m:2 * m + 2])
        model(batches[m])
        per_micro_batch += model.router_aux.end()
    model.router_aux.begin(weights, rows=2)
    model(batches[0])  # shape inference
    assert model.router_aux.total == 0
    for m in (2, 0, 1):
        model.router_aux.select(m)
        model(batches[m])
    torch.testing.assert_close(model.router_aux.end(), per_micro_batch)
    model.router_aux.begin(weights, rows=2)
    model.router_aux.select(3)
    with pytest.raises(RuntimeError, match="no weights"):
        model(batches[1])


def test_aux_gradient_is_the_gradient_of_the_loss():
    cfg = dataclasses.replace(MOE, num_hidden_layers=1)
    tokens = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(4))
    weights = torch.tensor([0.3, 0.7])
    grads = []
    for scale in (0.0, 1.0):
        model = _built(cfg)
        model.router_aux.begin(weights * scale)
        (model(tokens).sum() * 0).backward()
        grads.append(model.layers["0"].mlp.gate.weight.grad.clone())
    model = _built(cfg)
    moe = model.layers["0"].mlp
    x = model.layers["0"].post_attention_layernorm(
        model.embed_tokens(tokens) + model.layers["0"].self_attn(
            model.layers["0"].input_layernorm(model.embed_tokens(tokens)),
            model.rope_cos, model.rope_sin))
    r = route(moe.gate(x), 2, True)
    (load_balancing_loss(r.probs, r.experts) * weights).sum().backward()
    torch.testing.assert_close(grads[1] - grads[0], moe.gate.weight.grad, rtol=1e-4, atol=1e-7)


def test_layers_dense_first_then_every_freq():
    cfg = dataclasses.replace(MOE, num_hidden_layers=6, first_k_dense_replace=1, moe_layer_freq=2)
    assert moe_layers(cfg) == [2, 4]
    model = get_spec("moe").build(cfg)
    kinds = [type(layer.mlp).__name__ for layer in model.layers.values()]
    assert kinds == ["MLP", "MLP", "MoE", "MLP", "MoE", "MLP"]


MOE_JOB = ('[data]\nsource = "python-stdlib"\n[model]\nfamily = "moe"\nnum_experts = 8\n'
           'num_hidden_layers = 2\n')


@pytest.mark.parametrize(
    ("text", "overrides", "message"),
    [
        (MOE_JOB, ["model.num_experts_per_tok=9"], "model.num_experts_per_tok"),
        (MOE_JOB, ["model.num_experts=0"], "model.num_experts must be >= 1"),
        (MOE_JOB, ["model.first_k_dense_replace=2"], "no layer is a mixture of experts"),
        (MOE_JOB, ["model.moe_layer_freq=0"], "model.moe_layer_freq"),
        (MOE_JOB, ["model.router_aux_loss_coef=-1"], "model.router_aux_loss_coef"),
        (MOE_JOB, ["model.num_experts=5000"], "model.num_experts must be <= 4096"),
        (MOE_JOB, ["parallel.ep=0"], "parallel.ep must be >= 1"),
        ('[data]\nsource = "python-stdlib"\n[model]\nnum_experts = 8\n', [],
         'model.num_experts needs model.family = "moe"'),
    ],
)
def test_moe_config_errors_name_the_field(text, overrides, message):
    with pytest.raises(ConfigError, match=message):
        loads(text, overrides)


@pytest.mark.parametrize(
    ("overrides", "world", "message"),
    [
        (["parallel.ep=3"], 6, "parallel.ep must divide model.num_experts"),
        (["parallel.ep=4"], 2, "parallel.ep must divide dp"),
        (["parallel.tp=2", "parallel.sequence_parallel=true"], 2, "sequence_parallel"),
        (["parallel.pp=2", "parallel.pp_schedule=\"zero_bubble\"", "parallel.zero=2"], 2,
         "zero_bubble"),
        (["parallel.cp=2", "parallel.tp=2"], 4, "parallel.cp > 1 needs parallel.tp = 1"),
        (["parallel.cp=2", "parallel.pp=2"], 4, "parallel.cp > 1 needs parallel.tp = 1"),
        (["parallel.recompute=\"full\""], 1, "recompute"),
        (["parallel.reproducible=true", "parallel.cp=2"], 2, "parallel.reproducible"),
    ],
)
def test_layouts_moe_cannot_run_yet_are_refused(overrides, world, message):
    with pytest.raises(ConfigError, match=message):
        resolve(loads(MOE_JOB, overrides), world)


def test_ep_needs_the_moe_family():
    with pytest.raises(ConfigError, match='parallel.ep > 1 needs model.family = "moe"'):
        resolve(loads('[data]\nsource = "python-stdlib"\n', ["parallel.ep=2"]), 2)


def test_ep_with_cp_or_reproducible_resolves():
    layout = resolve(loads(MOE_JOB, ["parallel.ep=2", "parallel.cp=2"]), 8)
    assert (layout.dp, layout.cp, layout.ep, layout.world_size) == (4, 2, 2, 8)
    assert resolve(loads(MOE_JOB, ["parallel.ep=2", "parallel.reproducible=true"]), 4).ep == 2


def test_ep_is_a_factor_of_dp():
    layout = resolve(loads(MOE_JOB, ["parallel.ep=4"]), 8)
    assert (layout.dp, layout.ep, layout.world_size) == (8, 4, 8)


def test_tiny_moe_example_is_valid():
    cfg = load(REPO / "examples" / "tiny_moe.toml")
    assert cfg.model.family == "moe" and moe_layers(cfg.model) == [1, 2, 3]
    for ep in (1, 2, 4, 8):
        assert resolve(load(REPO / "examples" / "tiny_moe.toml", [f"parallel.ep={ep}"]), 8).ep == ep


def test_mixtral_8x7b_total_and_active_parameters():
    """Mistral AI's Mixtral announcement ("Mixtral of experts", 11 December 2023): 46.7B total
    parameters, 12.9B used per token. Config: Mixtral-8x7B-v0.1's config.json."""
    mixtral = ModelConfig(
        family="moe", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, vocab_size=32000,
        max_position_embeddings=32768, num_experts=8, num_experts_per_tok=2,
    )
    counts = moe_counts(mixtral)
    assert counts.total == pytest.approx(46.7e9, abs=0.05e9)
    assert counts.active == pytest.approx(12.9e9, abs=0.05e9)
    assert get_spec("moe").param_counts(mixtral).total == counts.total


def test_counts_match_the_built_module():
    cfg = dataclasses.replace(MOE, num_hidden_layers=5, first_k_dense_replace=1,
                              moe_layer_freq=2, num_shared_experts=1)
    model = get_spec("moe").build(cfg)
    counts = moe_counts(cfg)
    assert counts.total == sum(p.numel() for p in model.parameters())
    assert counts.experts == sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    per_expert = 3 * cfg.hidden_size * cfg.moe_intermediate_size
    assert counts.active == counts.total - len(moe_layers(cfg)) * 2 * per_expert


def test_ep_divides_the_routed_experts_memory_over_ep_and_their_zero_shards_over_edp():
    cfg = loads(MOE_JOB, ["model.hidden_size=64", "model.num_experts=8"]).model
    routed = 3 * 8 * cfg.hidden_size * cfg.intermediate_size * len(moe_layers(cfg))
    at = {ep: rank_memory(cfg, Layout(dp=8, ep=ep, zero=3), 128, 0).params // 4
          for ep in (1, 2, 8)}
    others = at[1] - routed // 8  # ZeRO-3 over dp 8: every tensor 1/8 (all divide evenly)
    for ep in (2, 8):
        # Experts: 1/ep of them, sharded again over dp/ep: still 1/8 of the routed total.
        assert at[ep] == others + routed // 8
    z1 = {ep: rank_memory(cfg, Layout(dp=8, ep=ep, zero=1), 128, 0) for ep in (1, 4)}
    # ZeRO-1 keeps parameters whole: ep 4 holds a quarter of the experts.
    assert z1[1].params - z1[4].params == 4 * (routed - routed // 4)
    assert z1[1].optimizer == z1[4].optimizer


def test_flops_follow_active_parameters_and_ep_adds_all_to_all():
    dense = loads(MOE_JOB, ["model.family=\"llama\"", "model.num_experts=0"]).model
    moe = loads(MOE_JOB, ["model.num_experts_per_tok=1", "model.moe_intermediate_size=384",
                          "model.router_aux_loss_coef=0"]).model
    # Top-1 of experts as wide as the dense MLP: the same matmul FLOPs, plus the router's.
    d = step_cost(dense, Layout(dp=2), 128, 16, 8, Hardware())
    m1 = step_cost(moe, Layout(dp=2), 128, 16, 8, Hardware())
    m2 = step_cost(moe, Layout(dp=2, ep=2), 128, 16, 8, Hardware())
    router = 6 * 8 * moe.hidden_size * moe.num_hidden_layers * 16 * 128 / 2
    assert m1.useful_s * Hardware().flops_per_s("fp32") == pytest.approx(
        d.useful_s * Hardware().flops_per_s("fp32") + router)
    assert m1.comm.ep == 0 and m2.comm.ep > 0 and m2.step_s > m1.step_s


def test_the_layout_search_lists_ep():
    job = load(REPO / "examples" / "tiny_moe.toml")
    result = search_layout(job, World(2, 4), 80 * 10**9,
                           SearchSpace.from_job(job, ("ep",)))
    eps = sorted({c.choice.ep for c in result.valid})
    assert eps == [1, 2, 4, 8]
    assert "ep4" in next(c for c in result.valid if c.choice.ep == 4).choice.describe()


def test_a_node_failure_replans_ep_when_the_survivors_cannot_keep_it():
    """ep 4 on 4 one-device nodes; 3 survive. dp 3 cannot hold ep 4: without parallel.replan
    the job waits, with replan = ["ep"] it runs on all 3 at an ep dividing 3 and 8 experts."""
    job = loads(MOE_JOB, ["parallel.ep=4", "train.global_batch=12"])
    four = [NodeInfo(n, 1) for n in "abcd"]
    assert plan_generation(job, four, 1, ("h", 1)).layout.ep == 4
    with pytest.raises(PlanError, match="parallel.ep must divide dp"):
        plan_generation(job, four[:3], 2, ("h", 1))
    elastic = loads(MOE_JOB, ["parallel.ep=4", "train.global_batch=12", 'parallel.replan=["ep"]'])
    plan = plan_generation(elastic, four[:3], 2, ("h", 1))
    assert (plan.layout.dp, plan.layout.ep, len(plan.ranks)) == (3, 1, 3)
    assert "re-planned to" in plan.layout_reason and "ep must divide dp" in plan.layout_reason
