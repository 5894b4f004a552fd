"""Tests for offpolicy_jax.tokenizers."""

import json
import re

import pytest

from offpolicy_jax.models import tokenizers as toks

QWEN_TEMPLATE = (
  "{%- for message in messages %}"
  "{%- if loop.first and message['role'] != 'system' %}"
  "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
  "{%- endif %}"
  "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
  "{%- endfor %}"
  "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
  "What is 12 + 7? The answer is 19.",
  "<think>add the numbers</think><answer>19</answer>",
  "Natalia sold clips to 48 of her friends in April.",
] * 5


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(
    vocab_size=400, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
  )
  tok.train_from_iterator(CORPUS, trainer)
  d = tmp_path_factory.mktemp("hf_tok")
  tok.save(str(d / "tokenizer.json"))
  config = {
    "tokenizer_class": "Qwen2Tokenizer",
    "bos_token": None,
    "eos_token": "<|im_end|>",
    "pad_token": "<|endoftext|>",
    "chat_template": QWEN_TEMPLATE,
    "added_tokens_decoder": {
      str(tok.token_to_id(s)): {"content": s, "special": True} for s in SPECIALS
    },
  }
  (d / "tokenizer_config.json").write_text(json.dumps(config))
  return d


def test_char_tokenizer_vocab_and_round_trip():
  tok = toks.CharTokenizer()
  assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2)
  assert tok.vocab_size == 57 <= 64
  text = "12+7=19 rev:abc? (x*y)/2<3>1"
  ids = tok.encode(text)
  assert len(ids) == len(text) and all(3 <= i < tok.vocab_size for i in ids)
  assert tok.decode(ids) == text
  assert tok.encode("0") == [3] and tok.encode("a") == [13]  # vocabulary is fixed
  assert tok.encode("1", add_bos=True) == [1, 4]
  # Decode stops at EOS and skips pad/bos.
  assert tok.decode([0, 0, 1, *tok.encode("42"), 2, *tok.encode("99")]) == "42"
  with pytest.raises(ValueError, match="'#'"):
    tok.encode("a#b")
  assert tok.apply_chat_template([{"role": "user", "content": "1+1="}]) == "1+1="


def test_hf_round_trip_and_special_ids(hf_dir):
  tok = toks.HFTokenizer.from_pretrained(hf_dir)
  assert tok.eos_id == tok._tok.token_to_id("<|im_end|>")
  assert tok.pad_id == tok._tok.token_to_id("<|endoftext|>")
  assert tok.bos_id is None
  assert tok.vocab_size == len(tok._tok.get_vocab(with_added_tokens=True)) > 256
  for text in CORPUS[:3] + ["unseen words: zebra 9001 ü"]:
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert tok.decode([tok.pad_id, *ids, tok.eos_id, *tok.encode("junk")]) == text


def test_hf_chat_template_matches_hand_written(hf_dir):
  tok = toks.HFTokenizer.from_pretrained(hf_dir)
  msgs = [{"role": "user", "content": "What is 2+2?"}]
  expected = (
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
    "<|im_start|>assistant\n"
  )
  assert tok.apply_chat_template(msgs) == expected
  no_gen = tok.apply_chat_template(msgs, add_generation_prompt=False)
  assert no_gen == expected[: -len("<|im_start|>assistant\n")]
  ids = tok.encode(expected)
  # Special tokens are atomic.
  assert ids[0] == tok._tok.token_to_id("<|im_start|>")
  assert (
    tok.decode(ids, skip_special_tokens=False) == "<|im_start|>system\nYou are a helpful assistant."
  )


def test_hf_matches_transformers(hf_dir):
  transformers = pytest.importorskip("transformers")
  ref = transformers.PreTrainedTokenizerFast.from_pretrained(str(hf_dir))
  tok = toks.HFTokenizer.from_pretrained(hf_dir)
  msgs = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Natalia sold 48 clips?"},
    {"role": "assistant", "content": "<think>x</think><answer>48</answer>"},
  ]
  for gen in (True, False):
    want = ref.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)
    assert tok.apply_chat_template(msgs, add_generation_prompt=gen) == want
  text = tok.apply_chat_template(msgs)
  assert tok.encode(text) == ref.encode(text, add_special_tokens=False)
  assert tok.eos_id == ref.eos_token_id and tok.pad_id == ref.pad_token_id


def test_saved_tokenizers_load_in_transformers(hf_dir, tmp_path):
  """What an export writes: the same ids and chat template through AutoTokenizer."""
  transformers = pytest.importorskip("transformers")
  tok = toks.HFTokenizer.from_pretrained(hf_dir)
  tok.save_pretrained(str(tmp_path / "hf"))
  msgs = [{"role": "user", "content": "Natalia sold 48 clips?"}]
  text = tok.apply_chat_template(msgs)
  for load in (transformers.AutoTokenizer, transformers.PreTrainedTokenizerFast):
    back, original = load.from_pretrained(str(tmp_path / "hf")), load.from_pretrained(hf_dir)
    assert back.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == text
    ids = back.encode(text, add_special_tokens=False)
    assert ids == original.encode(text, add_special_tokens=False)
    assert (back.eos_token_id, back.pad_token_id) == (tok.eos_id, tok.pad_id)
  assert ids == tok.encode(text)  # the class the tokenizer.json was written for
  char = toks.CharTokenizer()
  char.save_pretrained(str(tmp_path / "char"))
  back = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "char"))
  text = "12+34=?\nab c|x_y!"
  assert back.encode(text, add_special_tokens=False) == char.encode(text)
  assert back.decode(char.encode(text)) == text
  assert toks.HFTokenizer.from_pretrained(tmp_path / "char").encode(text) == char.encode(text)


def test_hf_errors(tmp_path, hf_dir):
  with pytest.raises(ValueError, match="tokenizer.json"):
    toks.HFTokenizer.from_pretrained(tmp_path)
  (tmp_path / "tokenizer.json").write_text((hf_dir / "tokenizer.json").read_text())
  tok = toks.HFTokenizer.from_pretrained(tmp_path)  # no config: no template
  with pytest.raises(ValueError, match="chat_template"):
    tok.apply_chat_template([{"role": "user", "content": "x"}])


def test_corrupt_files_are_named(tmp_path, hf_dir):
  tok_file, cfg_file = tmp_path / "tokenizer.json", tmp_path / "tokenizer_config.json"
  tok_file.write_text((hf_dir / "tokenizer.json").read_text())
  cfg_file.write_text('{"eos_token": "<|im_end|>",\n "pad_token": <|endoftext|>}')
  want = f"{cfg_file}: invalid JSON: Expecting value at line 2 column 15"
  with pytest.raises(ValueError, match=re.escape(want)):
    toks.HFTokenizer.from_pretrained(tmp_path)
  cfg_file.write_text('["eos_token"]')
  with pytest.raises(ValueError, match=re.escape(f"{cfg_file}: expected a JSON object, got list")):
    toks.HFTokenizer.from_pretrained(tmp_path)
  cfg_file.write_text((hf_dir / "tokenizer_config.json").read_text())
  tok_file.write_text((hf_dir / "tokenizer.json").read_text()[:100])  # truncated
  with pytest.raises(ValueError, match=re.escape(f"{tok_file}: cannot load the tokenizer: ")):
    toks.HFTokenizer.from_pretrained(tmp_path)


FANCY_TEMPLATE = (
  "{%- if tools %}{{- '<|im_start|>system\\n' }}{%- for tool in tools %}"
  "{{- '\\n' }}{{- tool | tojson }}{%- endfor %}{{- '<|im_end|>\\n' }}{%- endif %}"
  "{%- set ns = namespace(n=0) %}"
  "{%- for m in messages %}"
  "{%- if m.role == 'bad' %}{{ raise_exception('bad role') }}{%- endif %}"
  "{%- if loop.index > 2 %}{%- break %}{%- endif %}"
  "{%- set ns.n = ns.n + 1 %}"
  "{{- '<|im_start|>' + m.role + '\\n' + m.content | trim + '<|im_end|>\\n' }}"
  "{%- endfor %}{{- ns.n }}{{- eos_token }}"
  "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def test_template_features_match_transformers(hf_dir, tmp_path):
  transformers = pytest.importorskip("transformers")
  (tmp_path / "tokenizer.json").write_text((hf_dir / "tokenizer.json").read_text())
  config = json.loads((hf_dir / "tokenizer_config.json").read_text())
  config["chat_template"] = FANCY_TEMPLATE
  (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
  ref = transformers.PreTrainedTokenizerFast.from_pretrained(str(tmp_path))
  tok = toks.HFTokenizer.from_pretrained(tmp_path)
  tools = [{"name": "calc", "description": "évalue 2+2", "parameters": {"x": 1}}]
  msgs = [{"role": "user", "content": f" m{i} "} for i in range(4)]
  want = ref.apply_chat_template(msgs, tools=tools, tokenize=False, add_generation_prompt=True)
  assert tok.apply_chat_template(msgs, tools=tools) == want
  assert '"évalue 2+2"' in want and "m2" not in want
  with pytest.raises(Exception, match="bad role"):
    tok.apply_chat_template([{"role": "bad", "content": "x"}])
