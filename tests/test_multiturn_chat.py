"""Chat-template turns: a trajectory is the template's rendering of its conversation.

A tiny random Qwen-architecture decoder over a Qwen-style tokenizer (ChatML
template, `<|im_end|>` as EOS) plays episodes whose observations are rendered
by `rollout.episodes.turn_format(chat=True)`; the trajectory must equal the
template's rendering of the final conversation at every turn boundary
(generation prompts and end-of-turn tokens included).
"""

import jax
import numpy as np
import pytest

from offpolicy_jax import models
from offpolicy_jax.models import tokenizers
from offpolicy_jax.rollout import episodes
from offpolicy_jax.sampling import multiturn
from tests.test_tokenizers import hf_dir  # noqa: F401  (the tokenizer fixture)

OBSERVATIONS = ["The answer is 19.", "What is 12 + 7?"]


@pytest.fixture(scope="module")
def tok(hf_dir):  # noqa: F811
  return tokenizers.HFTokenizer.from_pretrained(hf_dir)


def test_chat_trajectory_equals_the_template_rendering_of_its_conversation(tok, numpy_init):
  fmt = episodes.turn_format(tok, chat=True)
  assert fmt.name == "chat" and fmt.eos_id is None and fmt.turn_end == ((tok.eos_id,),)
  graphdef, params = numpy_init(models.get_config("tiny", vocab_size=tok.vocab_size))
  sampler = multiturn.MultiTurnSampler(
    graphdef,
    max_new_tokens=96,
    turn_tokens=12,
    max_turns=3,
    observation_tokens=40,
    group_size=2,
    temperature=1.0,
    eos_id=fmt.eos_id,
    turn_end=fmt.turn_end,
  )
  user = "What is 12 + 7?"
  prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": user}]))
  prompts = np.asarray([prompt], np.int32)
  actions: dict[int, list[str]] = {0: [], 1: []}

  def respond(turn, rows, acts, final):
    out = []
    for r, a in zip(rows, acts, strict=True):
      actions[int(r)].append(fmt.action_text(a.tolist()))
      out.append((np.asarray(fmt.reply(a, OBSERVATIONS[turn % 2]), np.int32), False))
    return out

  out, info = sampler(params, prompts, np.asarray([len(prompt)]), jax.random.key(3), respond)
  tokens, mask = np.asarray(out.tokens), np.asarray(out.mask)
  for row in range(2):
    n = int(out.lengths[row])
    got = list(prompt) + tokens[row, :n].tolist()
    if got[-1] != tok.eos_id:  # the last turn, cut by its budget, closed as the template closes it
      got.append(tok.eos_id)
    # The policy's turns (the sampled ids, whatever text they decode to).
    turns, t = [], 0
    while t < n:
      end = t
      while end < n and mask[row, end] == mask[row, t]:
        end += 1
      if mask[row, t]:
        turns.append([i for i in tokens[row, t:end].tolist() if i != tok.eos_id])
      t = end
    assert int(info.turns[row]) == len(turns) == 3
    # The template's rendering of the conversation, each assistant message a
    # marker whose ids are then replaced by the turn's sampled ids.
    msgs = [{"role": "user", "content": user}]
    for i in range(len(turns)):
      msgs.append({"role": "assistant", "content": f"@{i}@"})
      if i + 1 < len(turns):
        msgs.append({"role": "user", "content": OBSERVATIONS[i % 2]})
    rendered = tok.apply_chat_template(msgs, add_generation_prompt=False)
    want = tok.encode(rendered[: rendered.rfind("<|im_end|>") + len("<|im_end|>")])
    for i, ids in enumerate(turns):
      marker = tok.encode(f"@{i}@")
      at = next(j for j in range(len(want)) if want[j : j + len(marker)] == marker)
      want[at : at + len(marker)] = ids
    assert got == want, (row, tok.decode(got, False), tok.decode(want, False))
