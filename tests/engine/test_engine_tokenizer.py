"""Tokenizer pieces of the engine (engine/tokenizer.py, engine/detokenizer.py) and the request's
lazily detokenized text: no model, no device."""

from __future__ import annotations

import json

import pytest

from umem_jax.core.request import Request
from umem_jax.core.sampling_params import SamplingParams
from umem_jax.engine.detokenizer import IncrementalDetokenizer, find_stop
from umem_jax.engine.tokenizer import ByteTokenizer, HFTokenizer, render_chat


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer(320, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    ids = tok.encode("héllo ✓")
    assert ids[0] == 1 and all(3 <= t < 259 for t in ids[1:])
    assert tok.decode(ids) == "héllo ✓"
    assert tok.decode([1, *tok.encode("a", False), 2, 300], skip_special_tokens=False) == "<bos>a<eos><extra_300>"
    assert tok.eos_token_ids == (2,)
    with pytest.raises(ValueError):
        ByteTokenizer(100)


def test_incremental_detokenizer_holds_partial_characters():
    tok = ByteTokenizer(320)
    text = "añ✓b"
    ids = tok.encode(text, add_special_tokens=False)
    d = IncrementalDetokenizer(tok, tok.encode("x"))
    pieces = [d.step(t) for t in ids]
    assert "".join(pieces) == text
    assert pieces[1] == ""  # the first byte of ñ alone is not a character yet
    assert all("\ufffd" not in p for p in pieces)


def test_incremental_detokenizer_starts_on_a_character():
    """A prompt ending in characters the tokenizer keeps as byte tokens (rare emoji): a window of
    the last few prompt tokens that cuts one of them would decode its bytes as U+FFFD, and a
    byte-fallback decoder then turns the whole run after them into U+FFFD, the generated characters
    included (the text came back empty or garbled).  The window starts on the character instead."""
    from tokenizers import Tokenizer, decoders, models

    vocab = {"<unk>": 0, "▁hello": 1, "▁world": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    hf = Tokenizer(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True))
    hf.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])

    class Tok:
        def decode(self, ids, skip_special_tokens=True):
            return hf.decode(ids, skip_special_tokens=skip_special_tokens)

    tok = Tok()
    raw = lambda s: [3 + b for b in s.encode()]  # noqa: E731 - one byte token a byte
    for prompt in ([1, *raw("🦩🦩")], raw("🦩𓀀"), [2, *raw("a𓀀")]):
        out = raw("🦩𓀀🦩") + [1, 2, *raw("é")]
        d = IncrementalDetokenizer(tok, prompt)
        pieces = [d.step(t) for t in out]
        assert "".join(pieces) == tok.decode(out) == "🦩𓀀🦩 hello worldé"
        assert all("\ufffd" not in p for p in pieces) and pieces[3] == "🦩"  # each character as it completes


def test_gemma_template_folds_the_system_message_and_refuses_other_orders():
    """The template used when a Gemma checkpoint ships none (the packaged GGUF): Gemma's own turn
    format -- the system message opens the first user turn, turns alternate user / model."""
    from umem_jax.engine.tokenizer import GEMMA_TEMPLATE

    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": " hi "},
            {"role": "assistant", "content": "yo"}, {"role": "user", "content": "q"}]
    assert render_chat(GEMMA_TEMPLATE, msgs, bos_token="<bos>") == (
        "<bos><start_of_turn>user\nBe brief.\n\nhi<end_of_turn>\n<start_of_turn>model\nyo<end_of_turn>\n"
        "<start_of_turn>user\nq<end_of_turn>\n<start_of_turn>model\n")
    assert render_chat(GEMMA_TEMPLATE, msgs[1:2], False, bos_token="<bos>") == \
        "<bos><start_of_turn>user\nhi<end_of_turn>\n"
    for bad in ([{"role": "wizard", "content": "x"}], [{"role": "user", "content": "a"}] * 2,
                [{"role": "assistant", "content": "a"}], msgs[:1] + msgs[:1]):
        with pytest.raises(ValueError, match="alternate user / assistant"):
            render_chat(GEMMA_TEMPLATE, bad, bos_token="<bos>")


def test_continue_final_message_ends_the_text_with_the_last_message():
    """continue_final_message (vLLM's, transformers' rule): the rendered chat is cut right after
    the last message's content (trimmed), so what the template writes after it -- the end of the
    turn -- is gone and the model goes on from that content; a new turn cannot follow too, and a
    template that rewrites the content leaves nothing to cut at."""
    from umem_jax.engine.tokenizer import GEMMA_TEMPLATE, PLAIN_TEMPLATE

    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": " An apple a day "}]
    assert render_chat(GEMMA_TEMPLATE, msgs, False, True, bos_token="<bos>") == (
        "<bos><start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\nAn apple a day")
    assert render_chat(PLAIN_TEMPLATE, msgs, False, True) == "user: hi\nassistant:  An apple a day"
    assert render_chat(PLAIN_TEMPLATE, msgs, False) == "user: hi\nassistant:  An apple a day \n"
    with pytest.raises(ValueError, match="^continue_final_message: cannot be true with add_generation_prompt"):
        render_chat(PLAIN_TEMPLATE, msgs, True, True)
    with pytest.raises(ValueError, match="^continue_final_message: the last message's content does not appear"):
        render_chat("{% for m in messages %}{{ m['content'] | upper }}{% endfor %}", msgs, False, True)


def test_chat_template_kwargs_are_the_templates_variables(tmp_path):
    """chat_template_kwargs (vLLM's: Qwen's enable_thinking, ...) reach the template as variables;
    the request's own fields cannot be set through them; the tokenizer's specials stay its own."""
    tmpl = ("{{ bos_token }}{% for m in messages %}{{ m['content'] }} {% endfor %}"
            "{% if enable_thinking is defined and not enable_thinking %}hi {% endif %}")
    msgs = [{"role": "user", "content": "hello"}]
    assert render_chat(tmpl, msgs, template_kwargs={"enable_thinking": False}) == "hello hi "
    assert render_chat(tmpl, msgs, template_kwargs={"enable_thinking": True}) == render_chat(tmpl, msgs) == "hello "
    for taken in ("messages", "add_generation_prompt"):
        with pytest.raises(ValueError, match=f"^chat_template_kwargs: {taken} is set by the request"):
            render_chat(tmpl, msgs, template_kwargs={taken: 1})
    tok = HFTokenizer(_hf_dir(tmp_path, tmpl))
    assert tok.encode_chat(msgs, template_kwargs={"enable_thinking": False, "bos_token": "world"}) == [2, 4, 6]


def test_find_stop():
    assert find_stop("hello world", 5, ["wor", "xyz"]) == (6, "wor")
    assert find_stop("hello world", 1, ["o w"]) is None  # ended before the new text
    assert find_stop("abcabc", 3, ["bc", "ca"]) == (2, "ca")  # earliest start wins
    assert find_stop("abc", 3, [""]) is None


def _hf_dir(tmp_path, chat_template=None):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<end_of_turn>": 3, "hello": 4, "world": 5, "hi": 6, "[UNK]": 7}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece()  # joins with spaces
    tok.add_special_tokens(["<pad>", "<eos>", "<bos>", "<end_of_turn>"])
    tok.save(str(tmp_path / "tokenizer.json"))
    cfg = {"bos_token": "<bos>", "eos_token": {"content": "<eos>"}}
    if chat_template:
        cfg["chat_template"] = chat_template
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 3]}))
    return tmp_path


def test_hf_tokenizer(tmp_path):
    tok = HFTokenizer(_hf_dir(tmp_path), extra_eos_ids=(1,))
    assert tok.encode("hello world") == [4, 5]
    assert tok.decode([2, 4, 5, 1]) == "hello world"
    assert tok.bos_token_id == 2 and tok.eos_token_ids == (1, 3)
    tmpl = "{{ bos_token }}{% for m in messages %}{{ m['content'] }} {% endfor %}"
    tok = HFTokenizer(_hf_dir(tmp_path, tmpl))
    assert tok.encode_chat([{"role": "user", "content": "hi"}]) == [2, 6]


def test_chat_template_errors():
    with pytest.raises(ValueError, match="role"):
        render_chat("{{ messages }}", [{"content": "x"}])
    with pytest.raises(ValueError, match="chat template: nope"):
        render_chat("{{ raise_exception('nope') }}", [])


def test_hf_tokenizer_without_config_uses_model_ids(tmp_path):
    d = _hf_dir(tmp_path)
    (d / "tokenizer_config.json").unlink()
    (d / "generation_config.json").unlink()
    tok = HFTokenizer(d, extra_eos_ids=(1,), bos_token_id=2)  # a GGUF conversion ships tokenizer.json alone
    assert tok.bos_token == "<bos>" and tok.eos_token == "<eos>" and tok.eos_token_ids == (1,)
    assert tok.encode_chat([{"role": "user", "content": "hi"}])[:1] == tok.encode("user", False)


def test_request_text_is_detokenized_when_read():
    tok = ByteTokenizer(320)
    ids = tok.encode("héllo wörld, ça va?", add_special_tokens=False)  # multi-byte characters
    eager, inc = "", IncrementalDetokenizer(tok, [1, 70, 71])
    for t in ids:
        eager += inc.step(t)
    for read_every in (1, 3, len(ids)):
        r = Request("x", None, [1, 70, 71], SamplingParams(max_tokens=64), arrival=0, seed=0, max_tokens=64)
        r.detok = IncrementalDetokenizer(tok, r.prompt_token_ids)
        for n, t in enumerate(ids, 1):
            r.output_token_ids.append(t)
            r.text_tokens = n
            if n % read_every == 0:
                assert eager.startswith(r.text)
        assert r.text == eager == "héllo wörld, ça va?"
    r.output_token_ids.append(2)  # a stop token the engine leaves out of the text
    assert r.text == eager and r.output().outputs[0].text == eager
