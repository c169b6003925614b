"""Text the tokenizer cannot read: `vlmreg train` warns, `vlmreg data preview` shows it (issue 31, item 3).

The reference is a hand count on a word-level vocabulary (the tutorial's LLaVA tokenizer: every word is one token,
a word it lacks is one ``<unk>``), not vlmreg's own tokenization.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

from tests.data.samples import data_uri, png_bytes
from vlmreg.cli import main
from vlmreg.data.unknown_tokens import survey_unknown_tokens
from vlmreg.sdk.example import Example, image_part, text_part
from vlmreg.testing import tiny_processor

LLAVA_SRC = Path(__file__).resolve().parents[2] / "examples" / "plugins" / "vlmreg-tiny-llava" / "src"
QUICK = [
    "--set",
    "trainer.steps=1",
    "--set",
    "trainer.prompts_per_step=2",
    "--set",
    "rollout.group_size=2",
    "--set",
    "rollout.max_tokens=4",
    "--set",
    "trainer.format_warmup_steps=0",
    "--set",
    "eval.every=0",
    "--set",
    "logging.rollout_page_every=0",
]
# "kite" and "crimson" are not in the tiny LLaVA vocabulary; every other word is. Per record: 6 prompt tokens and 1
# answer token. Two records: 14 tokens, of which 'kite' twice and 'crimson' once are <unk>.
QUESTION = "what colour is the kite ?"
EXPECTED = (
    "3 of 14 text tokens (21.4%) in the first 2 examples are the unknown token '<unk>' of family llava's "
    "tokenizer: 'kite' (2), 'crimson' (1); the model can never write the answers 'crimson'."
)


@pytest.fixture
def llava(vlmreg_add_plugin, monkeypatch, tmp_path_factory):
    """The tutorial's finished LLaVA plugin, registered in this process (its package copied alone, so that metadata an
    install left beside it in the source tree does not register it a second time)."""
    site = tmp_path_factory.mktemp("site")
    shutil.copytree(LLAVA_SRC / "vlmreg_tiny_llava", site / "vlmreg_tiny_llava")
    monkeypatch.syspath_prepend(str(site))
    # deferred: importable only from the copy put on sys.path just above
    import vlmreg_tiny_llava  # noqa: PLC0415

    vlmreg_add_plugin(vlmreg_tiny_llava, "llava")
    yield vlmreg_tiny_llava
    for name in [name for name in sys.modules if name.startswith("vlmreg_tiny_llava")]:
        del sys.modules[name]


def write_config(folder: Path, question: str, answers: tuple[str, ...]) -> str:
    """A tiny random LLaVA run on a JSONL file: one record per answer, each a 32x32 image and ``question``."""
    image = data_uri(png_bytes((32, 32), (200, 0, 0)))
    records = [
        {
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "image_url", "image_url": {"url": image}}, {"type": "text", "text": question}],
                }
            ],
            "answer": answer,
        }
        for answer in answers
    ]
    (folder / "kites.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    config = folder / "kites.toml"
    config.write_text(
        '[model]\ninit = "random"\nfamily = "llava"\n\n[data]\npaths = ["kites.jsonl"]\n\n'
        "[reward]\nfunctions = { exact_match = 1.0 }\n"
    )
    return str(config)


@pytest.fixture
def kite_config(tmp_path: Path) -> str:
    return write_config(tmp_path, QUESTION, ("red", "crimson"))


def test_survey_counts_the_unknown_words_as_a_hand_count(llava):
    tokenizer = llava.tiny_processor().tokenizer
    examples = [
        Example(
            "a",
            [
                {"role": "system", "content": "answer in one word"},
                {"role": "user", "content": [image_part("x"), text_part("What colour is the kite ?")]},
            ],
            "Scarlet",
        ),
        Example("b", [{"role": "user", "content": "how many kite ?"}], 3),  # an answer that is no string is not text
    ]
    found = survey_unknown_tokens(tokenizer, examples)
    # "answer in one word" 4 tokens ('one', 'word' unknown); 6 tokens ('kite'); "Scarlet" 1 (unknown); 4 ('kite')
    assert (found.tokens, found.unknown, found.examples) == (4 + 6 + 1 + 4, 2 + 1 + 1 + 1, 2)
    assert dict(found.words) == {"kite": 2, "one": 1, "word": 1, "Scarlet": 1}
    assert found.answers == ("Scarlet",) and found.too_many and found.unknown_token == "<unk>"
    assert survey_unknown_tokens(tokenizer, examples, limit=1).tokens == 4 + 6 + 1


def test_a_byte_level_tokenizer_has_no_unknown_token_to_count():
    tokenizer = tiny_processor("qwen3_vl").tokenizer
    assert tokenizer.unk_token_id is None
    assert survey_unknown_tokens(tokenizer, [Example("a", [{"role": "user", "content": "kite Ωμέγα 🪁"}], "x")]) is None


def test_train_warns_when_the_data_is_unknown_to_the_tokenizer(llava, kite_config, tmp_path, capsys):
    assert main(["train", kite_config, *QUICK, "--output-dir", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    assert f"warning: {EXPECTED}" in " ".join(out.split())


def test_train_says_nothing_when_the_tokenizer_knows_every_word(llava, tmp_path, capsys):
    config = write_config(tmp_path, "what colour is the shape ?", ("red", "blue"))
    assert main(["train", config, *QUICK, "--output-dir", str(tmp_path / "run")]) == 0
    assert "unknown token" not in capsys.readouterr().out


def test_preview_shows_the_prompt_as_the_model_gets_it(llava, kite_config, capsys):
    assert main(["data", "preview", kite_config, "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    first, second = record["samples"]
    # the chat template's rendering, tokenized and decoded: the 16 image tokens as one marker, 'kite' as <unk>
    assert first["model_text"] == "user :[image 32x32, 16 tokens]what colour is the <unk> ? </s> assistant :"
    assert (first["unknown_tokens"], first["answer_unknown_tokens"], first["answer_model_text"]) == (1, 0, "red")
    assert (second["answer_unknown_tokens"], second["answer_model_text"]) == (1, "<unk>")
    assert record["unknown_tokens"]["words"] == {"kite": 2, "crimson": 1} and record["unknown_tokens"]["answers"] == [
        "crimson"
    ]
    assert record["warning"].startswith(EXPECTED)
    assert main(["data", "preview", kite_config]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "tokens 'user :[image 32x32, 16 tokens]what colour is the <unk> ? </s> assistant :' (1 unknown)" in out
    assert "answer crimson (the model writes it as '<unk>')" in out and f"warning: {EXPECTED}" in out
