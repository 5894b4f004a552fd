"""Tests for offpolicy_jax.data (grain prompt pipelines)."""

import dataclasses
import json

import numpy as np
import pytest

from offpolicy_jax.models.tokenizers import CharTokenizer
from offpolicy_jax.rewards import tasks
from offpolicy_jax.rewards.tasks import ListSource, Task
from offpolicy_jax.rollout import data

TOK = CharTokenizer()
REVERSE = tasks.get_task("reverse", num_eval=50)


def _take(it, n):
  return [next(it) for _ in range(n)]


def _small_task(n=10, chat=False):
  exs = [{"prompt": f"q{i}=", "answer": str(i)} for i in range(n)]
  return Task(
    name="small",
    train_source=ListSource(exs),
    eval_source=ListSource(exs[:7]),
    prompt=lambda ex: ex["prompt"],
    reward=lambda ex, text: float(text == ex["answer"]),
    use_chat_template=chat,
    answer=lambda ex: ex["answer"],
    max_answer_len=1,
  )


def test_batch_layout_left_padding_and_answers():
  it = data.prompt_iterator(REVERSE, TOK, batch_size=4, max_prompt_len=12, seed=0)
  b = next(it)
  assert b["prompt_tokens"].shape == (4, 12) and b["prompt_tokens"].dtype == np.int32
  assert b["prompt_lengths"].dtype == np.int32 and b["answer_tokens"].dtype == np.int32
  assert b["answer_tokens"].shape == (4, REVERSE.max_answer_len + 1)
  assert b["valid"].all()
  exs = data.examples(REVERSE, "train", b["index"])
  for row, n, ans, ex in zip(
    b["prompt_tokens"], b["prompt_lengths"], b["answer_tokens"], exs, strict=True
  ):
    assert np.all(row[: 12 - n] == TOK.pad_id)  # left padding
    assert list(row[12 - n :]) == [TOK.bos_id, *TOK.encode(ex["prompt"])]
    real = ans[ans >= 0]
    assert list(real) == [*TOK.encode(ex["answer"]), TOK.eos_id]
    assert np.all(ans[len(real) :] == -1)


def test_deterministic_given_seed():
  a = _take(data.prompt_iterator(REVERSE, TOK, batch_size=3, max_prompt_len=12, seed=5), 3)
  b = _take(data.prompt_iterator(REVERSE, TOK, batch_size=3, max_prompt_len=12, seed=5), 3)
  c = _take(data.prompt_iterator(REVERSE, TOK, batch_size=3, max_prompt_len=12, seed=6), 3)
  for x, y in zip(a, b, strict=True):
    for k in x:
      np.testing.assert_array_equal(x[k], y[k])
  assert not all(np.array_equal(x["index"], y["index"]) for x, y in zip(a, c, strict=True))


@pytest.mark.parametrize("task", [REVERSE, _small_task()], ids=["procedural", "finite"])
def test_checkpoint_restore_resumes_identical_sequence(task):
  kw = dict(batch_size=3, max_prompt_len=12, seed=1)
  it = data.prompt_iterator(task, TOK, **kw)
  _take(it, 4)  # crosses an epoch boundary for the finite task
  state = json.loads(json.dumps(it.get_state()))  # state is JSON-serialisable
  want = _take(it, 5)
  fresh = data.prompt_iterator(task, TOK, **kw)
  fresh.set_state(state)
  got = _take(fresh, 5)
  for x, y in zip(want, got, strict=True):
    for k in x:
      np.testing.assert_array_equal(x[k], y[k])


def test_epochs_shuffle_and_cover_every_example():
  task = _small_task(10)
  it = data.prompt_iterator(task, TOK, batch_size=5, max_prompt_len=8, seed=0, num_epochs=2)
  batches = list(it)
  assert len(batches) == 4
  idx = np.concatenate([b["index"] for b in batches])
  assert sorted(idx[:10]) == list(range(10)) and sorted(idx[10:]) == list(range(10))
  assert list(idx[:10]) != list(idx[10:])  # reshuffled per epoch
  assert list(idx[:10]) != list(range(10))


def test_eval_split_finite_padded_and_sharded():
  task = _small_task(10)
  kw = dict(batch_size=3, max_prompt_len=8, seed=0, split="eval")
  batches = list(data.prompt_iterator(task, TOK, **kw))
  assert len(batches) == 3
  idx = np.concatenate([b["index"] for b in batches])
  valid = np.concatenate([b["valid"] for b in batches])
  assert list(idx[valid]) == list(range(7))  # eval: in order, no shuffle
  assert valid.sum() == 7 and not valid[-2:].any()
  shards = [
    np.concatenate(
      [
        b["index"][b["valid"]]
        for b in data.prompt_iterator(task, TOK, **kw, shard_index=s, shard_count=2)
      ]
    )
    for s in range(2)
  ]
  assert not set(shards[0]) & set(shards[1])
  assert sorted(np.concatenate(shards)) == list(range(7))


def test_train_shards_are_disjoint():
  task = _small_task(10)
  seen = []
  for s in range(2):
    it = data.prompt_iterator(
      task, TOK, batch_size=5, max_prompt_len=8, seed=0, shard_index=s, shard_count=2
    )
    seen.append(set(next(it)["index"]))
  assert seen[0] | seen[1] == set(range(10)) and not seen[0] & seen[1]


def test_chat_template_path_has_no_bos():
  task = _small_task(4, chat=True)
  b = next(data.prompt_iterator(task, TOK, batch_size=2, max_prompt_len=6, seed=0))
  for row, n, i in zip(b["prompt_tokens"], b["prompt_lengths"], b["index"], strict=True):
    assert list(row[6 - n :]) == TOK.encode(f"q{i}=")


def test_long_prompts_error_or_truncate():
  it = data.prompt_iterator(REVERSE, TOK, batch_size=2, max_prompt_len=5, seed=0)
  with pytest.raises(ValueError, match=r"train example \d+ .*max_prompt_len=5"):
    next(it)
  it = data.prompt_iterator(REVERSE, TOK, batch_size=2, max_prompt_len=5, seed=0, truncate=True)
  b = next(it)
  assert np.all(b["prompt_lengths"] == 5)
  for row, ex in zip(b["prompt_tokens"], data.examples(REVERSE, "train", b["index"]), strict=True):
    assert TOK.decode(row) == ex["prompt"][-5:]


def _prompt_task(prompts, chat=False):
  exs = [{"prompt": p, "answer": "1"} for p in prompts]
  return dataclasses.replace(
    _small_task(),
    train_source=ListSource(exs),
    eval_source=ListSource(exs[:2]),
    use_chat_template=chat,
  )


def test_truncated_prompts_are_flagged():
  task = _prompt_task(["ab=", "a" * 20, "cd=", "b" * 30, "ef="])
  it = data.prompt_iterator(task, TOK, batch_size=5, max_prompt_len=8, seed=0, truncate=True)
  b = next(it)
  assert b["truncated"].dtype == np.bool_ and b["truncated"].sum() == 2
  for row, n, i, cut in zip(
    b["prompt_tokens"], b["prompt_lengths"], b["index"], b["truncated"], strict=True
  ):
    text = task.prompt(task.train_source[int(i)])
    assert cut == (len(text) + 1 > 8)  # BOS + characters
    assert TOK.decode(row) == (text[-8:] if cut else text)  # the end of the prompt survives
    assert n == min(len(text) + 1, 8)


def test_filler_rows_are_not_flagged_truncated():
  task = _prompt_task(["a" * 20, "ab=", "cd="])  # eval split: the first two rows
  kw = dict(batch_size=3, max_prompt_len=8, seed=0, split="eval", truncate=True)
  b = next(data.prompt_iterator(task, TOK, **kw))
  assert list(b["valid"]) == [True, True, False]
  assert list(b["truncated"]) == [True, False, False]


def test_empty_prompt_is_an_error_naming_the_row():
  task = _prompt_task(["ab=", ""], chat=True)  # chat path: no BOS, so "" has 0 tokens
  it = data.prompt_iterator(task, TOK, batch_size=2, max_prompt_len=8, seed=0, shuffle=False)
  with pytest.raises(ValueError, match=r"train example 1 .*0 tokens"):
    next(it)


def test_scan_prompts_matches_the_pipeline():
  task = _prompt_task(["ab=", "abcd=", "x="])
  stats = data.scan_prompts(task, TOK, "train")
  assert (stats.size, stats.scanned) == (3, 3)
  assert stats.counts == {4: 1, 6: 1, 3: 1} and stats.first_row == {4: 0, 6: 1, 3: 2}
  top = max(max(data.encode_prompt(task, TOK, task.train_source[i])) for i in range(3))
  assert stats.max_id == (top, 0) and stats.answer_len == (2, 0)  # "1" + EOS
  assert data.scan_prompts(task, TOK, "train", limit=1).scanned == 1
  bad = _prompt_task(["ab=", "A="])
  with pytest.raises(ValueError, match="train example 1 .*'A'"):
    data.scan_prompts(bad, TOK, "train")


def test_bad_arguments():
  kw = dict(batch_size=2, max_prompt_len=12, seed=0)
  with pytest.raises(ValueError, match="split"):
    data.prompt_iterator(REVERSE, TOK, **kw, split="test")
  with pytest.raises(ValueError, match="shard_index"):
    data.prompt_iterator(REVERSE, TOK, **kw, shard_index=2, shard_count=2)
  with pytest.raises(ValueError, match="batch_size"):
    data.prompt_iterator(REVERSE, TOK, batch_size=0, max_prompt_len=8, seed=0)
  with pytest.raises(ValueError, match="answer"):
    next(data.prompt_iterator(REVERSE, TOK, **kw, answer_len=2))


def test_hf_tokenizer_chat_pipeline(tmp_path):
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

  from offpolicy_jax.models.tokenizers import HFTokenizer

  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
  trainer = trainers.BpeTrainer(
    vocab_size=300, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
  )
  tok.train_from_iterator(["q1= q2= user assistant"] * 3, trainer)
  tok.save(str(tmp_path / "tokenizer.json"))
  template = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + "
    "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\\n' }}{% endif %}"
  )
  config = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "chat_template": template}
  (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
  hf = HFTokenizer.from_pretrained(tmp_path)
  task = _small_task(4, chat=True)
  b = next(data.prompt_iterator(task, hf, batch_size=2, max_prompt_len=40, seed=0))
  for row, n, i in zip(b["prompt_tokens"], b["prompt_lengths"], b["index"], strict=True):
    assert np.all(row[: 40 - n] == hf.pad_id)
    text = hf._tok.decode(list(row[40 - n :]), skip_special_tokens=False)
    assert text == f"<|im_start|>user\nq{i}=<|im_end|>\n<|im_start|>assistant\n"
    answer = b["answer_tokens"][list(b["index"]).index(i)]
    assert list(answer[answer >= 0]) == [*hf.encode(str(i)), hf.eos_id]
