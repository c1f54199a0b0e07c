"""When GRPO's old log-probs come from the update forward (``hybridzero.rlhf.steps.rl.old_policy``): every rule of
the decision flips it, dropout is found where a train-mode forward would differ, a batch scored without the pass
never runs the actor, and a stepped actor is caught before a wrong ratio is built."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import transformers

from hybridzero.rlhf.engines import Roles
from hybridzero.rlhf.rollout.generate import Rollout, make_experience
from hybridzero.rlhf.settings import GRPOSettings, PPOSettings
from hybridzero.rlhf.steps.rl.old_policy import check_on_policy, has_dropout, old_logprobs_from_update


def _grpo(**changes: Any) -> GRPOSettings:
    base: dict[str, Any] = {"reward_funcs": ["tests.workers.rlvr_rewards:digit_share"], "reward_model": False}
    return GRPOSettings(**{**base, **changes})


def _decide(s: PPOSettings, updates: int = 1, micro: int = 0, dropout: bool = False, ptx: bool = False) -> bool:
    return old_logprobs_from_update(s, updates, micro, dropout=dropout, ptx=ptx)


def test_one_on_policy_step_an_iteration_takes_the_update_forwards_log_probs() -> None:
    assert _decide(_grpo())
    assert _decide(_grpo(gradient_accumulation_steps=4), updates=4, micro=8)  # 4 mini-batches, one step


@pytest.mark.parametrize(
    ("settings", "kwargs"),
    [
        ({"old_logprobs": "rollout_pass"}, {}),
        ({"num_iterations": 2}, {}),  # a second pass runs on stepped weights
        ({}, {"updates": 2}),  # two mini-batches, two steps: the second is off-policy
        ({"gradient_accumulation_steps": 2}, {"updates": 2, "micro": 1}),  # the boundary falls mid-iteration
        ({"gradient_accumulation_steps": 2}, {"updates": 4}),  # two steps an iteration
        ({"gradient_accumulation_steps": 2}, {"updates": 2, "ptx": True}),  # a ptx step between the two
        ({"rollout_engine": "vllm", "vllm_importance_sampling_correction": True}, {}),
        ({}, {"dropout": True}),
    ],
)
def test_each_rule_keeps_the_rollout_pass(settings: dict[str, Any], kwargs: dict[str, Any]) -> None:
    assert not _decide(_grpo(**settings), **kwargs)


def test_ppo_always_runs_the_pass() -> None:
    assert not _decide(PPOSettings())  # PPO's rewards read old - reference before any update


def test_dropout_is_found_in_modules_and_in_functional_config_entries() -> None:
    llama = transformers.LlamaConfig(
        vocab_size=37, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=24
    )
    assert not has_dropout(transformers.LlamaForCausalLM(llama))
    llama.attention_dropout = 0.1  # functional: no nn.Dropout module anywhere
    assert has_dropout(transformers.LlamaForCausalLM(llama))
    gpt2 = transformers.GPT2Config(vocab_size=37, n_embd=16, n_layer=1, n_head=2)
    assert has_dropout(transformers.GPT2LMHeadModel(gpt2))
    quiet = transformers.GPT2Config(
        vocab_size=37, n_embd=16, n_layer=1, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0
    )
    quiet.summary_first_dropout = 0.0
    assert not has_dropout(transformers.GPT2LMHeadModel(quiet))
    assert has_dropout(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.5)))


def test_a_stepped_actor_is_caught() -> None:
    check_on_policy(None, 7)  # scored with the pass: any step count
    check_on_policy(3, 3)
    with pytest.raises(RuntimeError, match="sampled at actor step 3 .* updated at step 4"):
        check_on_policy(3, 4)


class _NoForward(torch.nn.Module):
    """An actor that must not be called."""

    sequence_parallel = None

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the actor ran a forward")


def test_scoring_without_the_pass_runs_no_actor_forward() -> None:
    seq = torch.tensor([[0, 5, 6, 7, 2], [4, 5, 6, 2, 0]])
    mask = torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 1, 0]])
    ro = Rollout(seq, mask, mask[:, 1:].clone(), prompt_width=2)
    roles = Roles(actor=_NoForward(), ref=_NoForward(), reward=None)  # type: ignore[arg-type]
    exp = make_experience(roles, ro, with_ref=False, with_old=False)
    assert exp.logprobs.shape == (2, 4) and not exp.logprobs.any()
    assert torch.equal(exp.ref_logprobs, exp.logprobs)  # no KL term: the reference is the old policy (zero KL)
    with pytest.raises(AssertionError, match="ran a forward"):
        make_experience(roles, ro, with_ref=False)
